"""What ``mdtk plan --emit DIR`` writes for a plan (pure: dicts, the CLI writes them).

The trainer YAML follows ``toolkit/train/config.py``'s schema and points ``deepspeed.config`` at
the DeepSpeed JSON, which ``toolkit.dsconfig.generator.build_config`` builds for the plan's
ZeRO stage and offload exactly as ``mdtk ds-config`` would. The trainer sets the batch keys,
clipping and optimizer hyper-parameters from the YAML and checks the JSON with the same lint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from toolkit.dsconfig.generator import Request, build_config
from toolkit.memory import Cluster, ModelShape
from toolkit.planner.cost import Workload
from toolkit.planner.search import Budget, Planned, check_fit, train_shape


class EmitError(ValueError):
    """A plan mdtk cannot emit as a runnable config; the message says why and what to do."""


@dataclass(frozen=True)
class RunSpec:
    """What the YAML needs beyond the plan: where the model, tokenizer and data are."""

    output_dir: str
    model_path: str | None = None  # HF folder or hub id to fine-tune
    model_config: str | None = None  # config.json to pretrain from scratch
    tokenizer: str | None = None
    data: tuple[str, ...] = ()
    data_mode: str = "pretrain"
    steps: int = 100
    lr: float = 3e-4


def steps_for(tokens: float | None, work: Workload, default: int = 100) -> int:
    """Optimizer steps that cover ``tokens`` (rounded up), ``default`` without a token count."""
    if not tokens:
        return default
    return max(1, math.ceil(tokens / (work.global_batch * work.seq_len)))


def deepspeed_json(model: ModelShape, work: Workload, plan: Planned, cluster: Cluster,
                   budget: Budget = Budget(), lr: float = 3e-4) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed config of ``plan`` and the generator's notes."""
    if not plan.runnable:
        raise EmitError(f"{plan.candidate.describe()}: {plan.note}. Pick another --emit-rank.")
    c = plan.candidate
    option = check_fit(model, work, c, cluster, budget)
    if not option.fits:  # cannot happen for a searched plan: the same test chose it
        raise EmitError(f"{c.describe()} does not fit: {option.reason}")
    req = Request(model=model, cluster=cluster, train=train_shape(work, c),
                  layout=c.layout(), stage=str(c.zero), lr=lr,
                  headroom=budget.headroom, gpu_reserve=budget.gpu_reserve)
    notes: list[str] = []
    return build_config(req, option, c.layout().resolve(cluster.world_size), notes), notes


def trainer_yaml(plan: Planned, work: Workload, run: RunSpec, ds_config_path: str
                 ) -> dict[str, Any]:
    """The ``mdtk train`` config of ``plan`` (validated by the CLI with the trainer's schema)."""
    c = plan.candidate
    if bool(run.model_path) == bool(run.model_config):
        raise EmitError("give the model as an HF folder / hub id or as a config.json, not both.")
    if not run.data:
        raise EmitError("--emit needs training data: --data FILE (json/jsonl/parquet/txt, a glob, "
                        "a folder or a hub dataset; repeat it for several).")
    model: dict[str, Any] = {"path": run.model_path} if run.model_path else {
        "config": run.model_config, "tokenizer": run.tokenizer}
    if run.tokenizer and run.model_path:
        model["tokenizer"] = run.tokenizer
    precision = work.dtype
    return {
        "output_dir": run.output_dir,
        "model": model,
        "parallel": {"tp": c.tp, "pp": c.pp, "vpp": c.vpp if c.vpp > 1 else None, "cp": c.cp,
                     "ep": c.ep, "sequence_parallel": c.sequence_parallel},
        "deepspeed": {"zero_stage": c.zero, "offload": "cpu" if c.offload != "none" else "none",
                      "config": ds_config_path},
        "data": {"mode": run.data_mode, "sources": list(run.data), "validation_split": 0.0},
        "optim": {"lr": run.lr, "min_lr": run.lr / 10, "warmup_steps": min(100, run.steps // 10),
                  "decay": "cosine", "weight_decay": 0.1, "clip_grad": 1.0},
        "train": {"steps": run.steps, "micro_batch": c.micro_batch,
                  "global_batch": work.global_batch, "seq_len": work.seq_len,
                  "precision": precision, "recompute": c.recompute},
        "checkpoint": {"interval": 0, "keep_last": 1, "resume": "auto"},
        "logging": {"interval": 1},
    }
