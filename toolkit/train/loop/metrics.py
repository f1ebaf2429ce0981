"""Per-step training metrics: throughput, model FLOPs, MFU, memory; JSON lines + TensorBoard/W&B.

``{output_dir}/metrics.jsonl`` gets one JSON object per logged step (appended and flushed line by
line, so a crashed run keeps everything it logged and a resumed run continues the same file).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The peak table and the FLOP count live with the planner (one source for MFU and estimates):
# model_flops_per_token(shape, seq_len) is 6 N + 12 L H s, PaLM's model FLOPs (recomputation not
# credited), of the run's ModelShape (``toolkit.train.model.RunModel``).
from toolkit.planner.devices import peak_tflops  # noqa: F401 - re-exported for the trainer
from toolkit.planner.flops import (
    matmul_params_per_token,  # noqa: F401 - re-exported
    model_flops_per_token,  # noqa: F401 - re-exported
)


def device_name() -> str | None:
    """The accelerator's name (None on CPU)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    tflops_per_device: float
    mfu: float | None


def throughput(tokens: int, seconds: float, flops_per_token: float, num_devices: int,
               peak: float | None) -> Throughput:
    """``tokens`` processed by the whole job (global batch * seq_len) in ``seconds``.

    TFLOP/s per device divides by every device of the job (tp, pp, cp and dp ranks alike), so MFU
    is not inflated by ignoring model-parallel ranks. ``peak`` None (CPU, unknown GPU) -> mfu None.
    """
    if seconds <= 0 or num_devices < 1:
        raise ValueError(f"seconds={seconds} and num_devices={num_devices} must be positive.")
    tps = tokens / seconds
    tflops = tps * flops_per_token / num_devices / 1e12
    return Throughput(tps, tflops, tflops / peak if peak else None)


def memory_bytes() -> int:
    """Peak memory of this process: CUDA max allocated, or the peak resident set on CPU."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def gather_memory() -> list[int]:
    """``memory_bytes()`` of every rank (collective when torch.distributed is initialised)."""
    import torch.distributed as dist

    mine = memory_bytes()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [int(x) for x in out]


@dataclass
class StepMetrics:
    """One line of metrics.jsonl. ``mem_per_rank`` in bytes, rank order. ``val_loss`` only on
    the steps that ran an evaluation."""

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    tflops_per_device: float | None
    mfu: float | None
    mem_per_rank: list[int]
    step_time_s: float | None = None
    consumed_samples: int | None = None
    val_loss: float | None = None
    tokens_by_source: dict[str, int] | None = None  # pretraining: tokens trained per source
    extra: dict[str, float] = field(default_factory=dict)  # the objective's (DPO: TRL's names)

    def flat(self) -> dict[str, Any]:
        """The record's keys with ``extra``'s among them (``rewards/chosen``, ...)."""
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        return {**d, **extra}

    def to_json(self) -> str:
        return json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                           for k, v in self.flat().items()})


class MetricsWriter:
    """Writes metrics on the one rank that logs (the trainer picks it). JSON lines always;
    TensorBoard when asked (``torch.utils.tensorboard``); W&B when asked and installed."""

    def __init__(self, output_dir: str | Path, *, tensorboard: bool = False, wandb: bool = False,
                 wandb_project: str | None = None, run_config: dict[str, Any] | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))
        if wandb:
            import wandb as wandb_module  # config validation already checked it is installed

            self._wandb = wandb_module.init(project=wandb_project or "mdtk", config=run_config,
                                            dir=str(output_dir), resume="allow")

    def log(self, m: StepMetrics) -> None:
        self._file.write(m.to_json() + "\n")
        self._file.flush()
        scalars = {k: v for k, v in m.flat().items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        for name, tokens in (m.tokens_by_source or {}).items():
            scalars[f"tokens_by_source/{name}"] = tokens
        if m.mem_per_rank:
            scalars["mem_max_rank_gib"] = max(m.mem_per_rank) / 2**30
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"train/{k}", v, m.step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=m.step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``{output_dir}/metrics.jsonl``."""
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
