"""What a config means for a world size (``RunPlan``: the resolved layout and the batch split),
and how many optimizer steps it trains."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import ConfigError
from toolkit.parallel.layout import LayoutError, ParallelLayout, ResolvedLayout
from toolkit.train.config.schema import TrainConfig


@dataclass(frozen=True)
class RunPlan:
    """What the config means for this world size: the resolved layout and the batch split."""

    layout: ResolvedLayout
    micro_batch: int
    global_batch: int
    grad_accum: int

    @property
    def dp(self) -> int:
        return self.layout.dp


def plan(cfg: TrainConfig, world_size: int) -> RunPlan:
    """Resolve dp from the world size (``ParallelLayout.resolve``) and derive gradient
    accumulation = global_batch / (micro_batch * dp)."""
    wanted = cfg.parallel.layout()
    try:
        layout = wanted.resolve(world_size)
    except LayoutError as e:
        raise ConfigError(f"parallel: {e}{_how_to_launch(wanted, world_size)}") from None
    dp = layout.dp
    mb = cfg.train.micro_batch
    gb = cfg.train.global_batch or mb * dp
    if gb % (mb * dp):
        per = mb * dp
        lower, upper = gb // per * per, (gb // per + 1) * per
        options = ", ".join(str(x) for x in (lower, upper) if x > 0)
        raise ConfigError(
            f"train.global_batch={gb} is not divisible by train.micro_batch * dp = {mb} * {dp} = "
            f"{per} ({layout.describe()} on {world_size} ranks): set train.global_batch to a "
            f"multiple of {per} (e.g. {options}) or change train.micro_batch / the layout.")
    return RunPlan(layout=layout, micro_batch=mb, global_batch=gb, grad_accum=gb // (mb * dp))


def ranks_needed(layout: ParallelLayout) -> int | None:
    """The fewest ranks ``layout`` runs on (dp as set, else the least that fits the experts)."""
    mp = layout.model_parallel
    for n in range(mp, mp * max(layout.dp or 1, layout.ep * layout.expert_tp) + 1, mp):
        try:
            return layout.resolve(n).world_size
        except LayoutError:
            continue
    return None


def _how_to_launch(layout: ParallelLayout, world_size: int) -> str:
    """For one process (no launcher): the command that starts the ranks the layout needs."""
    need = ranks_needed(layout) if world_size == 1 else None
    if not need or need == 1:
        return ""
    return (f" This is one process; the layout needs {need} ranks: start them with `mdtk launch "
            f"-n {need} -- train CONFIG [key=value ...]` (or torchrun --nproc-per-node {need}).")


def total_steps(cfg: TrainConfig, num_train_samples: int, global_batch: int) -> int:
    """``train.steps``, or the optimizer steps that cover ``train.epochs`` passes (rounded up)."""
    if cfg.train.steps is not None:
        return cfg.train.steps
    if num_train_samples < 1:
        raise ConfigError("the training set is empty: check data.sources and data.seq_len.")
    steps = max(1, -(-int(cfg.train.epochs * num_train_samples) // global_batch))
    # GRPO: a generation batch serves grpo.num_iterations optimizer steps
    return steps * (cfg.grpo.num_iterations if cfg.data.mode == "grpo" else 1)
