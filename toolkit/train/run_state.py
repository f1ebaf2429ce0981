"""What the phases of one training run hand each other (``RunState``) and what a run did
(``TrainResult``), typed, so that the loop, the checkpoints and the run's variant (full weights
or adapters, ``toolkit.train.variants``) share one description of the run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from toolkit.adapters import Adapter
    from toolkit.train.checkpoints.folders import CheckpointManager
    from toolkit.train.checkpoints.saver import Saver
    from toolkit.train.checkpoints.state import TrainingState
    from toolkit.train.config import RunPlan, TrainConfig
    from toolkit.train.data import GlobalBatchSampler, PreparedData
    from toolkit.train.model import RunModel
    from toolkit.train.objectives.base import Objective


@dataclass
class TrainResult:
    """What a run did, identical on every rank (export_dir only where it was written)."""

    steps: int
    start_step: int
    losses: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    metrics: list[dict[str, float]] = field(default_factory=list)  # per step, besides the loss
    val_metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # (DPO: TRL's)
    eval_metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # eval: tasks
    export_dir: str | None = None
    export_max_abs_diff: float | None = None  # HF export vs the trained model's logits
    adapter_dir: str | None = None  # peft: the HF PEFT folder (export.adapter_dir)
    adapter_max_abs_diff: float | None = None  # PEFT's model with it vs the trained model
    ds_config: dict[str, Any] = field(default_factory=dict)
    ds_notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunState:
    """What the phases of one run hand each other once the trainer's ``_prepare`` has built it
    (each rank holds its own model chunks and data-parallel share); the DeepSpeed engine goes
    alongside."""

    cfg: TrainConfig
    plan: RunPlan
    model: RunModel  # the model's description (config.json read once) and shape
    data: PreparedData
    sampler: GlobalBatchSampler  # this rank's share of every global batch
    chunks: list[torch.nn.Module]
    adapter: Adapter  # the family's mapping of this model (HF <-> megatron-core names)
    ds_config: dict[str, Any]
    ds_notes: list[str]
    total_steps: int
    objective: Objective  # the data mode's micro-batches and loss (DPO: with its reference)
    variant: Variant  # what the run trains: every weight, or adapters on a frozen base

    @property
    def checkpoints(self) -> CheckpointManager:
        from toolkit.train.checkpoints.folders import CheckpointManager

        c = self.cfg.checkpoint
        return CheckpointManager(self.cfg.checkpoint_dir, c.keep_last, c.keep_every,
                                 describe=self._describe_model)

    def _describe_model(self, folder: Path) -> None:
        """A checkpoint's ``hf_config/``: config.json as read, tokenizer and generation config
        from the local model and tokenizer folders (a hub id stays in trainer_state.json)."""
        from toolkit.checkpoint.megatron_layout import write_hf_config

        local = [Path(p) for p in (self.cfg.model.path, self.cfg.tokenizer_path)
                 if p and Path(p).is_dir()]
        write_hf_config(folder, self.model.spec.write, local)

    def training_state(self, step: int) -> TrainingState:
        """The run's record for a checkpoint of ``step`` (what resume checks it against)."""
        from toolkit.train.checkpoints.state import TrainingState

        cfg, plan = self.cfg, self.plan
        return TrainingState(
            step=step, consumed_samples=self.sampler.consumed_samples(step),
            world_size=plan.layout.world_size, dp_size=plan.layout.dp,
            global_batch=plan.global_batch, micro_batch=plan.micro_batch, seed=cfg.train.seed,
            layout=dataclasses.asdict(plan.layout), data_fingerprint=self.data.key,
            config=_absolute_model_paths(cfg.to_dict()),
        )

    def check_resume(self, saved: TrainingState) -> None:
        """The checkpoint is this run's (layout may differ: every variant reshards)."""
        from toolkit.train.checkpoints.state import check_resume

        check_resume(saved, layout=self.plan.layout, global_batch=self.plan.global_batch,
                     seed=self.cfg.train.seed, data_fingerprint=self.data.key,
                     dp_change_ok=self.sampler.supports_dp_change, reshard_ok=True)


class Variant(Protocol):
    """What a run trains: how it is prepared on the loaded model, saved, resumed, exported."""

    #: its checkpoints go through the run's ``Saver`` (which may write them in the background)
    uses_saver: bool

    def attach(self, cfg: TrainConfig, chunks: list[Any], adapter: Adapter) -> Variant:
        """Prepare the loaded chunks (e.g. add adapters); the variant as the run uses it."""
        ...

    def save(self, state: RunState, engine: Any, saver: Saver, step: int) -> Path | None:
        """Save step ``step`` (the published folder, or None while it is written)."""
        ...

    def resume(self, state: RunState, engine: Any, path: Path, saved: TrainingState) -> str:
        """Fill the engine from checkpoint ``path`` (already checked to be this run's); the
        log line."""
        ...

    def export(self, state: RunState, engine: Any, result: TrainResult) -> None:
        """Write what ``export`` asks for, filling ``result``."""
        ...


def _absolute_model_paths(config: dict) -> dict:
    """The config with local model paths made absolute, so that a checkpoint names its HF
    folder wherever it is read from (``mdtk convert`` from another directory); hub ids stay."""
    model = dict(config.get("model") or {})
    for key in ("path", "config", "tokenizer"):
        value = model.get(key)
        if isinstance(value, str) and value and Path(value).exists():
            model[key] = str(Path(value).resolve())
    return {**config, "model": model}


def describe_layout(layout: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items()
                    if k in ("dp", "tp", "pp", "vpp", "ep") and v not in (None, 1)) or "1 rank"


def reseed_unless_restored(path: Path, seed: int, step: int, same_layout: bool) -> None:
    """RNG states belong to the ranks of the saved layout: restore them there, elsewhere (or
    when the checkpoint holds none) reseed per step."""
    from toolkit.train.checkpoints.state import load_rng

    if not same_layout or not load_rng(path, dist.get_rank()):
        torch.manual_seed(seed + step)


def log(msg: str) -> None:
    """A line of the run's log (rank 0)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[mdtk train] {msg}", flush=True)
