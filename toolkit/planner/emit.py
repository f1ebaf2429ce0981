"""What ``mdtk plan --emit DIR`` writes for a plan: the dicts, and ``emit`` that writes them.

The trainer YAML follows the trainer's schema (``toolkit/train/config/schema.py``) and points
``deepspeed.config`` at the DeepSpeed JSON, which ``toolkit.dsconfig.generator.build_config``
builds for the plan's ZeRO stage and offload exactly as ``mdtk ds-config`` would. The trainer
sets the batch keys, clipping and optimizer hyper-parameters from the YAML and checks the JSON
with the same lint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.adapters.spec import config_file
from toolkit.dsconfig.generator import Request, build_config
from toolkit.errors import UserError
from toolkit.memory import Cluster, ModelShape
from toolkit.planner.cost import Workload
from toolkit.planner.search import Budget, Planned, check_fit, train_shape

if TYPE_CHECKING:
    from toolkit.planner.report import PlanReport


class EmitError(UserError):
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
    return max(1, math.ceil(tokens / (work.global_batch * work.rows * work.seq_len)))


def deepspeed_json(model: ModelShape, work: Workload, plan: Planned, cluster: Cluster,
                   budget: Budget = Budget(), lr: float = 3e-4) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed config of ``plan`` and the generator's notes."""
    if not plan.runnable:
        raise EmitError(f"{plan.candidate.describe()}: {plan.note}. Pick another --emit-rank.")
    c = plan.candidate
    option = check_fit(model, work, c, cluster, budget)
    if not option.fits:  # cannot happen for a searched plan: the same test chose it
        raise EmitError(f"{c.describe()} does not fit: {option.reason}")
    layout = c.layout()
    req = Request(model=model, cluster=cluster, train=train_shape(work, c),
                  layout=layout, stage=str(c.zero), lr=lr,
                  headroom=budget.headroom, gpu_reserve=budget.gpu_reserve)
    notes: list[str] = []
    if c.hpz > 1:
        notes.append(f"ZeRO++ hpZ: zero_hpz_partition_size={c.hpz} (a secondary parameter copy "
                     f"sharded inside each node; exact). Its groups are {c.hpz} consecutive "
                     "ranks: each node's ranks must be numbered consecutively, as torchrun and "
                     "mdtk launch do.")
    if c.qwz or c.qgz:
        notes.append("ZeRO++ qwZ/qgZ (allowed with --allow-quantized-comm): lossy int8 "
                     "parameter gathers / int4 gradient reduction; DeepSpeed's CUDA quantizer "
                     "kernels, so the run needs GPUs (mdtk's CPU mode refuses it).")
    return build_config(req, option, layout, notes), notes


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
    dpo = {"dpo": {"precompute_reference": not work.reference_model}} if work.pairs else {}
    return {
        "output_dir": run.output_dir,
        "model": model,
        "parallel": {"tp": c.tp, "pp": c.pp, "vpp": c.vpp if c.vpp > 1 else None, "cp": c.cp,
                     "ep": c.ep, "sequence_parallel": c.sequence_parallel},
        "deepspeed": {"zero_stage": c.zero, "offload": "cpu" if c.offload != "none" else "none",
                      "config": ds_config_path},
        "data": {"mode": "dpo" if work.pairs else run.data_mode, "sources": list(run.data),
                 "validation_split": 0.0},
        **dpo,
        "optim": {"lr": run.lr, "min_lr": run.lr / 10, "warmup_steps": min(100, run.steps // 10),
                  "decay": "cosine", "weight_decay": 0.1, "clip_grad": 1.0},
        "train": {"steps": run.steps, "micro_batch": c.micro_batch,
                  "global_batch": work.global_batch, "seq_len": work.seq_len,
                  "precision": precision, "recompute": c.recompute},
        "checkpoint": {"interval": 0, "keep_last": 1, "resume": "auto"},
        "logging": {"interval": 1},
    }


def model_source(model_arg: str, folder: Path) -> tuple[str | None, str | None]:
    """(model.path, model.config): a folder with weights is fine-tuned; a preset or a bare
    config.json is pretrained from its config (presets are written next to the YAML)."""
    path = Path(model_arg)
    if path.is_dir() and any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
        return str(path.resolve()), None
    if path.is_dir():
        return None, str(config_file(path).resolve())
    if path.is_file():
        return None, str(path.resolve())
    from toolkit.adapters.presets import MODEL_PRESETS, get_preset
    from toolkit.adapters.spec import write_config

    if model_arg.lower() in MODEL_PRESETS:
        target = write_config(folder, get_preset(model_arg), name="model_config.json")
        return None, str(target.resolve())
    return model_arg, None  # a hub id: fine-tune it


@dataclass(frozen=True)
class Emitted:
    """What ``emit`` wrote and how to run it."""

    yaml_path: Path
    ds_path: Path
    plan: Planned
    launch: str  # the mdtk launch command line (before ``-- train YAML``)
    notes: list[str]


def emit(report: PlanReport, folder: Path, model_arg: str, *, rank: int = 1,
         data: Sequence[str] = (), data_mode: str = "pretrain", tokenizer: str | None = None,
         output_dir: str | None = None, steps: int | None = None,
         check: Callable[[dict[str, Any]], Any] = lambda raw: None) -> Emitted:
    """Write ``folder/train.yaml`` and ``folder/ds_config.json`` of the ``rank``-th plan of
    ``report``. ``check`` validates the YAML with the trainer's schema (the CLI passes
    ``toolkit.train.config.config_from_dict``; the planner sits below the trainer). Raises
    EmitError (or what ``check`` raises) with the message to print."""
    import yaml

    from toolkit.dsconfig import lint, write_json

    result, cluster, work = report.result, report.setting.cluster, report.work
    if work.grpo:
        raise EmitError("--emit with --grpo: a GRPO run needs its reward functions (grpo."
                        "rewards); plan with --grpo, then write the grpo section yourself "
                        "(bundled:examples/grpo_tiny.yaml shows one).")
    if rank > len(result.plans):
        raise EmitError(f"--emit-rank {rank}: only {len(result.plans)} plans fit.")
    plan = result.plans[rank - 1]
    folder.mkdir(parents=True, exist_ok=True)
    model_path, model_config = model_source(model_arg, folder)
    run = RunSpec(output_dir=output_dir or str((folder / "run").resolve()), model_path=model_path,
                  model_config=model_config, tokenizer=tokenizer, data=tuple(data or ()),
                  data_mode=data_mode, steps=steps or steps_for(report.setting.tokens, work))
    if model_config and not tokenizer:
        raise EmitError(f"--model {model_arg} is a config without weights (pretraining from "
                        "scratch): give --tokenizer (a tokenizer folder or hub id).")
    ds_path = (folder / "ds_config.json").resolve()
    ds_config, notes = deepspeed_json(report.setting.shape, work, plan, cluster,
                                      report.setting.budget)
    raw = trainer_yaml(plan, work, run, str(ds_path))
    lint_report = lint(ds_config, world_size=cluster.world_size, layout=plan.candidate.layout(),
                       gpus_per_node=cluster.gpus_per_node)
    if lint_report.errors:
        raise EmitError("the emitted DeepSpeed config failed the lint:\n  "
                        + "\n  ".join(lint_report.errors))
    write_json(ds_path, ds_config)
    check(raw)  # the trainer's own schema and cross-key checks
    from toolkit.atomic import write_text

    yaml_path = folder / "train.yaml"
    write_text(yaml_path, yaml.safe_dump(raw, sort_keys=False))
    launch = f"mdtk launch -n {cluster.gpus_per_node}" + (
        f" --nnodes {cluster.nodes} --node-rank $NODE_RANK --master-addr $MASTER_ADDR"
        if cluster.nodes > 1 else "")
    return Emitted(yaml_path, ds_path, plan, launch, notes)
