"""The DeepSpeed config mdtk's trainer runs with: the generator's choice (as ``mdtk ds-config``
makes it) or the user's JSON (linted as ``mdtk ds-config --check`` lints a file), with the keys
the trainer owns set from the run, and the result linted again before any engine sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.dsconfig.generator import ConfigError, Request, generate
from toolkit.dsconfig.lint import lint, load_config
from toolkit.parallel.layout import ResolvedLayout

QUIET_STEPS = 10**9  # steps_per_print: the trainer writes its own metrics lines


@dataclass(frozen=True)
class TrainerKeys:
    """What the trainer decides itself whatever the config says: the batch split of its run
    plan, clipping, the AdamW hyper-parameters and the precision. It sets the LR of every step
    (so a resume is exact), hence DeepSpeed's scheduler is dropped."""

    micro_batch: int
    global_batch: int
    grad_accum: int
    clip_grad: float
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    precision: str  # bf16 | fp16 | fp32


def with_trainer_keys(config: dict[str, Any], keys: TrainerKeys, cp: int = 1) -> dict[str, Any]:
    """A copy of ``config`` with the trainer's keys set and no scheduler.

    DeepSpeed's data-parallel group is dp x cp (context-parallel ranks reduce gradients too), and
    it checks ``train_batch_size == micro x accumulation x that group's size``: with cp > 1 its
    batch counts each of a sample's cp shares once (global_batch x cp)."""
    config = {**config}
    config.pop("scheduler", None)
    config.update(
        train_batch_size=keys.global_batch * cp, train_micro_batch_size_per_gpu=keys.micro_batch,
        gradient_accumulation_steps=keys.grad_accum, gradient_clipping=keys.clip_grad,
        steps_per_print=QUIET_STEPS,
    )
    opt = {**config.get("optimizer", {"type": "AdamW"})}
    opt["params"] = {**opt.get("params", {}), "lr": keys.lr, "weight_decay": keys.weight_decay,
                     "betas": list(keys.betas), "eps": keys.eps}
    config["optimizer"] = opt
    for key in ("bf16", "fp16"):
        config[key] = {"enabled": keys.precision == key}
    return config


def trainer_config(source: Request | str | Path, keys: TrainerKeys, layout: ResolvedLayout,
                   gpus_per_node: int | None = None) -> tuple[dict[str, Any], list[str]]:
    """(config, notes saying why): ``source`` is a generator Request (stage and offload chosen
    from the memory model) or the path of the user's DeepSpeed JSON. ``layout``: the run's;
    ``gpus_per_node``: this run's ranks per node. The config runs on this machine, so kernels
    it lacks (ZeRO++'s quantizer on CPU) are errors.

    Raises ConfigError naming what the lint refused (ValueError for a file that is not a JSON
    object)."""
    if isinstance(source, Request):
        plan = generate(source)
        config, notes = plan.config, [f"chose {plan.chosen.label}: {plan.chosen.reason}",
                                      *plan.notes]
    else:
        config = load_config(source)
        notes = [f"user DeepSpeed config {source}"]
    report = lint(config, world_size=layout.world_size, layout=layout,
                  gpus_per_node=gpus_per_node, runs_here=True)
    if not report.ok:
        raise ConfigError("; ".join(report.errors))
    notes += report.warnings
    final = with_trainer_keys(config, keys, layout.cp)
    report = lint(final, world_size=layout.world_size, layout=layout,
                  gpus_per_node=gpus_per_node, runs_here=True)
    if not report.ok:
        raise ConfigError("with the keys the trainer sets (batch split, clipping, optimizer, "
                          "precision): " + "; ".join(report.errors))
    return final, notes
