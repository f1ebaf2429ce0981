"""Resume a trainer checkpoint at another layout (dp, tp, pp, vpp, ep, ZeRO stage, offload).

DeepSpeed's own ``load_checkpoint`` reads back only the per-rank shards of the layout that wrote
them. When the layout differs, every rank instead reads the checkpoint as canonical full tensors
(``toolkit.checkpoint.deepspeed``: the fp32 master weights and Adam's ``exp_avg`` /
``exp_avg_sq``, each reassembled from all ZeRO partitions and model-parallel shards through the
adapter's mapping), cuts its own parameters' slices with the plans that load HF checkpoints, and
writes them into the engine: the model weights, and through DeepSpeed's fragment API
(``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``: ZeRO 1-3, offload) the fp32
master weights and moments of whatever partition this rank owns. Adam's step count is the
trainer's step (mdtk trains without skipped steps). Elementwise states slice like the weights,
so the resumed run continues as the uninterrupted one would (fp32: to rounding).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.deepspeed import MOMENTS
from toolkit.mapping import MappingError, TensorPlan
from toolkit.train.checkpoints.state import ENGINE_TAG, ResumeError

if TYPE_CHECKING:
    from toolkit.adapters import Adapter

_LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "ep", "etp", "dp")


def saved_stage(path: str | Path) -> int:
    """The ZeRO stage the engine checkpoint under ``path`` was written with."""
    from toolkit.checkpoint.deepspeed import zero_stage

    return zero_stage(Path(path))


def same_layout(saved: dict[str, Any], layout: Any) -> bool:
    """Whether ``layout`` (a resolved ParallelLayout) is the one a checkpoint was saved at."""
    def norm(k: str, v: Any) -> Any:
        return (v or 1) if k in ("vpp", "cp", "ep") else v
    now = {k: norm(k, getattr(layout, k)) for k in _LAYOUT_KEYS}
    return all(norm(k, saved.get(k)) == now[k] for k in _LAYOUT_KEYS)


def sources(path: str | Path, adapter: Adapter) -> dict[str, Any]:
    """HF-named full-tensor readers of a trainer checkpoint: fp32 weights and each moment."""
    from toolkit.checkpoint.deepspeed import STATES, open_source

    engine = Path(path) / ENGINE_TAG
    try:
        return {s: open_source(engine, lambda *_: adapter, state=s)[0] for s in STATES}
    except CheckpointError as e:
        raise ResumeError(f"checkpoint {path} cannot be resumed at another layout: {e}") from e


def local_slice(plan: TensorPlan, source: Any) -> torch.Tensor:
    """This rank's tensor of ``plan`` from a full-tensor reader (padding rows zero, fp32)."""
    numel = 1
    for n in plan.shape:
        numel *= n
    covered = sum(p.numel for p in plan.pieces)
    out = (torch.zeros if covered != numel else torch.empty)(plan.shape, dtype=torch.float32)
    for piece in plan.pieces:
        part = source.read(piece.source, piece.src).float()
        out[tuple(slice(a, b) for a, b in piece.dst)] = piece.to_local(part)
    return out


def load_resharded(path: str | Path, engine: Any, chunks: list[Any], adapter: Adapter,
                   step: int, samples: int) -> None:
    """Fill ``engine`` (built for this run's layout) from the checkpoint at ``path`` saved at
    another layout: weights, fp32 master weights, Adam moments and step counts (collective in
    ZeRO-3, whose fragment API gathers; every rank reads the files itself)."""
    from toolkit.adapters.live import current_coord

    src = sources(path, adapter)
    coord = current_coord()
    plans = adapter.plan(coord)
    params = {(i, n): p for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    shapes = {k: tuple(getattr(p, "ds_shape", p.shape)) for k, p in params.items()}  # ZeRO-3
    if shapes != {(t.chunk, t.name): tuple(t.shape) for t in plans}:
        raise MappingError(f"resume at another layout: this rank's parameters differ from the "
                           f"mapping's plan at {coord}.")
    values = ((params[(t.chunk, t.name)], local_slice(t, src["fp32"]),  # one at a time
               {k: local_slice(t, src[k]) for k in MOMENTS}) for t in plans)
    write_engine_state(engine, values, step, samples)


def write_engine_state(engine: Any, values: Iterable[tuple[Any, torch.Tensor, dict[str, Any]]],
                       step: int, samples: int) -> None:
    """Set each (parameter, fp32 weight, Adam moments) of this rank in ``engine``: the model
    weight, and through DeepSpeed's fragment API the fp32 master and moments of whatever
    partition this rank owns (collective in ZeRO-3); Adam's step count is ``step``."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    stage = engine.zero_optimization_stage()
    optimizer = engine.optimizer
    base = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer under ZeRO
    # Adam creates its states lazily at the first step; ZeRO-3 steps one flat sub group at a
    # time through the base optimizer's param_groups, so its flats are listed here
    flats = [p for g in base.param_groups for p in g["params"]]
    _create_states(base, getattr(optimizer, "fp32_partitioned_groups_flat", flats), step)
    if stage in (1, 2):  # link each parameter's fragment to the flat states just created
        for lps, flat in zip(optimizer.bit16_groups, optimizer.single_partition_of_fp32_groups,
                             strict=True):
            for lp in lps:
                if getattr(lp, "_hp_mapping", None) is not None:
                    lp._hp_mapping.set_optim_state_fragment(flat, base.state[flat])
    with torch.no_grad():
        for p, weight, moments in values:
            if stage == 0:  # no ZeRO: the fp32 model weights are the optimizer's parameters
                p.data.copy_(weight)
                for k, v in moments.items():
                    base.state[p][k].copy_(v)
                continue
            if stage != 3:
                p.data.copy_(weight)  # the bit16 view; ZeRO-3 refreshes its partition below
            safe_set_full_fp32_param(p, weight)
            for k, v in moments.items():
                safe_set_full_optimizer_state(p, v, k)
        if stage == 3:
            for fp32, lp in zip(optimizer.fp32_partitioned_groups_flat,
                                optimizer.fp16_partitioned_groups_flat, strict=True):
                if fp32.numel() and lp is not None:
                    lp.data.copy_(fp32.data)
    engine.global_steps = step
    engine.global_samples = samples


def _create_states(base: Any, flats: list[torch.Tensor], step: int) -> None:
    """Zeroed Adam moments for every (flat) parameter ``base`` steps and the step count (bias
    correction): a tensor for torch's Adam, an int for DeepSpeed's CPU Adam."""
    torch_adam = type(base).__module__.startswith("torch.")
    for group in base.param_groups:
        if "step" in group:
            group["step"] = step
    for p in flats:
        state = base.state[p]
        for k in MOMENTS:
            if k not in state:
                state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] = torch.tensor(float(step)) if torch_adam else step

