"""Where DPO's reference log-probabilities come from: one small interface, two kinds.

``attach(split, index_lists, batches)`` sets ``batch["ref_logps"]`` (the reference's summed
completion log-probabilities of the batch's 2b rows, chosen rows first) on the micro-batches of
one optimizer step or one evaluation, before the policy's schedule runs them; only the last
pipeline stage reads them.

- ``ModelReference``: a frozen model with the policy's layout, run forward-only over the same
  micro-batches by megatron-core's schedule (so tp, sp, pp, vpp, cp and ep need nothing of their
  own). Either its own chunks (``build_model_reference``: the starting model or another
  checkpoint; under ZeRO-3 partitioned over the data-parallel group like the policy) or the
  policy's chunks inside a context that switches LoRA adapters off (no second copy).
- ``PrecomputedReference``: every pair's reference log-probabilities computed once before
  training by a ``ModelReference`` that is then freed (``precompute``), looked up by sample index;
  cached beside the data (``precomputed``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from toolkit.train.loop.engine import forward_outputs
from toolkit.train.loop.zero3_release import destroy_engine
from toolkit.train.objectives.dpo.loss import sequence_logps

Batch = dict[str, torch.Tensor]
SPLITS = ("train", "validation")


def collect_logps(per_token: torch.Tensor, batch: Batch, counts=None):
    """The forward-only schedule's loss function: no loss, the rows' log-probabilities."""
    logps = sequence_logps(per_token, batch["loss_mask"].to(torch.float32))
    return logps.sum() * 0.0, {"logps": logps.detach().clone()}


class ModelReference:
    """A frozen model run forward-only with the policy's layout. ``context`` wraps each run (the
    policy's chunks with adapters off); ``engine`` is a DeepSpeed engine partitioning ``chunks``
    (ZeRO-3), destroyed by ``close``."""

    def __init__(self, chunks: Sequence[torch.nn.Module], seq_len: int, *,
                 context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 engine: Any = None, label: str = "DPO reference"):
        self.chunks, self.seq_len, self.label = list(chunks), seq_len, label
        self.context, self.engine = context, engine
        self._placed = engine is not None  # a ZeRO-3 engine places its partitions itself

    def logps(self, batches: list[Batch]) -> list[torch.Tensor]:
        """Per micro-batch, the rows' summed completion log-probabilities (last stage; [] on
        the others)."""
        return [o["logps"] for o in self.run(batches, collect_logps)]

    def run(self, batches: list[Batch], collect: Callable[..., Any]) -> list[dict[str, Any]]:
        """Per micro-batch, what ``collect`` (a forward-only loss function returning ``(0,
        values)``) took from the model's output (last stage; [] on the others)."""
        if not batches:
            return []
        if not self._placed:  # once: checked at the first run, after the policy's engine
            check_on_device(self.chunks, self.label)  # placed the LoRA path's (shared) chunks
            self._placed = True
        rows = int(batches[0]["tokens"].shape[0])
        with self.context():
            return forward_outputs(self.chunks, iter(batches), collect,
                                   num_microbatches=len(batches), micro_batch=rows,
                                   seq_len=self.seq_len)

    def attach(self, split: str, index_lists: Sequence[np.ndarray], batches: list[Batch]) -> None:
        for batch, logps in zip(batches, self.logps(batches), strict=False):
            batch["ref_logps"] = logps

    def close(self) -> None:
        if self.engine is not None:
            destroy_engine(self.engine)
        self.chunks, self.engine = [], None


class PrecomputedReference:
    """Reference log-probabilities looked up by sample index: ``tables[split]`` is [N, 2]
    float64 (chosen, rejected) for every sample of the split."""

    def __init__(self, tables: dict[str, np.ndarray]):
        self.tables = tables

    def attach(self, split: str, index_lists: Sequence[np.ndarray], batches: list[Batch]) -> None:
        table = self.tables[split]
        for batch, idx in zip(batches, index_lists, strict=True):
            batch["ref_logps"] = torch.from_numpy(np.ascontiguousarray(table[idx].T).reshape(-1))

    def close(self) -> None:
        self.tables = {}


# -- the reference model -----------------------------------------------------------------------

def reference_ds_config(ds_config: dict[str, Any]) -> dict[str, Any] | None:
    """The DeepSpeed config that partitions a frozen model like the policy under ZeRO-3 (stage
    3, no optimizer, the policy's parameter offload); None below stage 3 (replicated over dp,
    as TRL does)."""
    zero = ds_config.get("zero_optimization", {})
    if int(zero.get("stage", 0)) != 3:
        return None
    keep = {k: v for k, v in zero.items() if k != "offload_optimizer"}
    out = {k: ds_config[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                     "gradient_accumulation_steps", "bf16", "fp16")
           if k in ds_config}
    return {**out, "zero_optimization": keep, "steps_per_print": 10**9}


def freeze(chunks: Sequence[torch.nn.Module]) -> None:
    for chunk in chunks:
        chunk.eval()
        for p in chunk.parameters():
            p.requires_grad_(False)


def check_on_device(chunks: Sequence[torch.nn.Module], label: str = "DPO reference") -> None:
    """Every parameter and buffer of ``chunks`` on the device the micro-batches go to
    (``runtime.device()``, where DeepSpeed's engine put the policy), else a clear error before
    the forward fails deep inside an embedding lookup. ZeRO-3 partitions (a LoRA policy's
    shared chunks) are DeepSpeed's to place."""
    device = _device()
    for chunk in chunks:
        for name, t in (*chunk.named_parameters(), *chunk.named_buffers()):
            if hasattr(t, "ds_id"):  # a ZeRO-3 partition: DeepSpeed places it
                continue
            if t.device != device:
                raise RuntimeError(f"{label}: {name} is on {t.device}, the trainer runs on "
                                   f"{device} (the frozen model was not placed like the "
                                   "policy).")


def partition(chunks: Sequence[torch.nn.Module], mpu: Any, ds_config: dict[str, Any]) -> Any:
    """A DeepSpeed engine (no optimizer) that partitions the frozen ``chunks`` when the policy
    runs ZeRO-3 (DeepSpeed places the partitions, as the policy's); otherwise None, with the
    chunks moved where DeepSpeed's engine moves the policy's (``place_like_engine``)."""
    config = reference_ds_config(ds_config)
    if config is None:
        from toolkit.train.loop.engine import place_like_engine

        place_like_engine(chunks)
        return None
    import deepspeed

    from toolkit import runtime

    runtime.prepare_deepspeed()
    engine, *_ = deepspeed.initialize(model=chunks[0], config=config, mpu=mpu)
    return engine


# -- precomputed log-probabilities -------------------------------------------------------------

def _rounds(n: int, micro: int, dp: int, dp_rank: int, multiple: int) -> tuple[list, list]:
    """Index lists covering ``n`` samples in rounds of micro x dp (the last round, and the round
    count up to a multiple of ``multiple``, padded by wrapping), and which entries are real."""
    per_round = micro * dp
    rounds = -(-n // per_round)
    rounds = -(-rounds // multiple) * multiple
    out, real = [], []
    for r in range(rounds):
        stream = np.arange(r * per_round + dp_rank * micro, r * per_round + (dp_rank + 1) * micro)
        out.append(stream % n)
        real.append(stream < n)
    return out, real


def precompute(reference: ModelReference, splits: dict[str, Any], micro: int, dp: int,
               dp_rank: int) -> dict[str, np.ndarray]:
    """Every sample's reference log-probabilities, [N, 2] float64 per split, on every rank
    (collective). Each data-parallel rank runs its share; the last stage's tp/cp rank 0 of each
    fills its rows and one all-reduce gathers them."""
    writer = (ps.is_pipeline_last_stage(ignore_virtual=True)
              and ps.get_tensor_model_parallel_rank() == 0
              and ps.get_context_parallel_rank() == 0)
    tables = {}
    for name, split in splits.items():
        if split is None:
            continue
        table = torch.zeros(len(split), 2, dtype=torch.float64)
        index_lists, real = _rounds(len(split), micro, dp, dp_rank,
                                    ps.get_pipeline_model_parallel_world_size())
        step = 64  # micro-batches per schedule call: bounded host memory for the batches
        for a in range(0, len(index_lists), step):
            lists = index_lists[a:a + step]
            logps = reference.logps([split.batch(i) for i in lists])
            if writer:
                for idx, keep, lp in zip(lists, real[a:a + step], logps, strict=True):
                    table[idx[keep]] = lp.double().cpu().view(2, -1).T[torch.from_numpy(keep)]
        device_table = table.to(_device())
        dist.all_reduce(device_table)
        tables[name] = device_table.cpu().numpy()
    return tables


def _device() -> torch.device:
    from toolkit import runtime

    return runtime.device()


def cache_key(data_key: str, reference: str, precision: str) -> str:
    """What the cached log-probabilities depend on: the samples (the data's cache key: sources,
    tokenizer, seq_len...), the reference (path, and its files' names, sizes and modification
    times; a hub id as it is) and the precision."""
    files = []
    path = Path(reference)
    if path.is_dir():
        files = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir())
                 if f.is_file()]
        reference = str(path.resolve())
    text = json.dumps([data_key, reference, files, precision])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_cached(folder: Path) -> dict[str, np.ndarray] | None:
    if not (folder / "meta.json").is_file():
        return None
    return {name: np.load(folder / f"{name}.npy") for name in SPLITS
            if (folder / f"{name}.npy").is_file()}


def save_cached(folder: Path, tables: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Written to a temporary sibling and renamed (``toolkit.atomic.building``); rank 0 only."""
    from toolkit.atomic import building

    with building(folder) as tmp:
        for name, table in tables.items():
            np.save(tmp / f"{name}.npy", table, allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
