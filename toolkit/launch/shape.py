"""Whether a training config fits a cluster shape (nodes x GPUs per node), checked before
anything is started or queued: a layout or batch that cannot fill the ranks fails in seconds
on the login node, not after the job has waited in the queue."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.train import config as cfgmod
from toolkit.train.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class Fit:
    """A config that fits: the loaded config, its run plan, and notes worth printing."""

    cfg: TrainConfig
    plan: cfgmod.RunPlan
    notes: tuple[str, ...] = ()


def is_config_arg(arg: str) -> bool:
    """Whether the first argument of ``mdtk launch`` names a training YAML (launch mode) rather
    than an mdtk command (``mdtk launch -n 2 -- env``)."""
    return arg.endswith((".yaml", ".yml")) or arg.startswith("bundled:")


def _model_parallel(cfg: TrainConfig) -> str:
    p = cfg.parallel
    dims = [f"{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp), ("ep", p.ep))
            if v and v > 1]
    return ", ".join(dims) or "no model parallelism"


def check_fit(config: str, overrides: list[str], nodes: int, per_node: int) -> Fit:
    """Load ``config`` with ``overrides`` and check its layout and batch on ``nodes`` x
    ``per_node`` ranks; a ConfigError names the numbers (e.g. "3 GPUs with tp=2")."""
    cfg = cfgmod.load_config(config, overrides)
    world = nodes * per_node
    try:
        plan = cfgmod.plan(cfg, world)
    except ConfigError as e:
        raise ConfigError(
            f"{world} GPUs ({nodes} node{'s' * (nodes > 1)} x {per_node}) with "
            f"{_model_parallel(cfg)}: {str(e).removeprefix('parallel: ')}") from None
    notes = []
    inner = plan.layout.tp * plan.layout.cp
    if nodes > 1 and per_node % inner:
        notes.append(f"tp*cp = {inner} does not divide the {per_node} GPUs of a node: tensor "
                     "and context parallel traffic crosses the network (slow); use a "
                     "divisor of the GPUs per node.")
    return Fit(cfg, plan, tuple(notes))
