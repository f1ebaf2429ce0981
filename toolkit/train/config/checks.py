"""Checks that involve several keys, one named function per section; per-key types, choices and
minimums are checked while building (``typed``). Paths that must already exist are checked here
too. ``validate`` runs ``CHECKS`` in order (the first refusal is the one reported); a new
section's check is one more function in the tuple."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from toolkit import rules
from toolkit.errors import ConfigError, UserError
from toolkit.models import kernels
from toolkit.parallel.layout import LayoutError
from toolkit.train.config.schema import (
    DistillSection,
    DpoSection,
    GrpoSection,
    KtoSection,
    RewardSection,
    TrainConfig,
)
from toolkit.train.objectives import spec as post_spec
from toolkit.train.objectives.dpo import spec as dpo_spec
from toolkit.train.objectives.grpo import spec as grpo_spec

#: the modes whose rows are not SFT's (no packing, no SFT formats): what they read
ROW_MODES = {"dpo": "prompt/chosen/rejected rows, one pair per sample",
             "reward": "prompt/chosen/rejected rows, one pair per sample",
             "kto": "prompt/completion/label rows, one row per sample"}


def check_output_dir(cfg: TrainConfig) -> None:
    if not cfg.output_dir:
        raise ConfigError("output_dir is required: set output_dir: runs/NAME (or output_dir=...).")


def check_model(cfg: TrainConfig) -> None:
    m = cfg.model
    if bool(m.path) == bool(m.config):
        raise ConfigError("set exactly one of model.path (HF folder or hub id to fine-tune) and "
                          "model.config (HF config to pretrain from scratch); got "
                          f"path={m.path!r}, config={m.config!r}.")
    if m.config and not m.tokenizer:
        raise ConfigError("model.config (pretraining from scratch) needs model.tokenizer: a "
                          "tokenizer folder or hub id.")


def check_parallel(cfg: TrainConfig) -> None:
    try:
        layout = cfg.parallel.layout()
    except LayoutError as e:
        raise ConfigError(f"parallel: {e}") from None
    if layout.tp > 1 and layout.expert_tp != layout.tp and not layout.experts_whole_on_tp_ranks:
        # measured (issue 39): DeepSpeed reduces and norms expert grads over an expert-data-
        # parallel group that then spans tp ranks; only etp = tp, or etp 1 without ep, is exact
        raise ConfigError(
            f"parallel.etp={layout.expert_tp} with tp={layout.tp} and ep={layout.ep}: the "
            "trainer reduces expert gradients exactly with expert-TP equal to tp, or expert-TP "
            "1 without expert parallelism. Set parallel.etp to tp, or etp=1 with ep=1.")


def check_deepspeed(cfg: TrainConfig) -> None:
    ds = cfg.deepspeed
    if ds.offload == "nvme" and not ds.nvme_path:
        raise ConfigError("deepspeed.offload=nvme needs deepspeed.nvme_path: a folder on a fast "
                          "local NVMe disk.")
    if ds.offload in ("cpu", "nvme") and ds.zero_stage == 0:
        _, reason = rules.offload_problems(0, ds.offload)[0]
        raise ConfigError(f"deepspeed.offload={ds.offload} with deepspeed.zero_stage=0: {reason} "
                          "Set deepspeed.zero_stage to 1, 2 or 3 (parameters are offloaded only "
                          "at stage 3).")
    if ds.config != "auto" and not Path(ds.config).is_file():
        raise ConfigError(f"deepspeed.config={ds.config!r}: no such file; give a DeepSpeed JSON "
                          "or 'auto' to generate one.")
    zeropp = [k for k, on in (("hpz_partition_size", ds.hpz_partition_size > 1),
                              ("quantized_weights", ds.quantized_weights),
                              ("quantized_gradients", ds.quantized_gradients)) if on]
    if zeropp and ds.config != "auto":
        raise ConfigError(f"deepspeed.{zeropp[0]} with deepspeed.config={ds.config}: the file "
                          "decides; set zero_hpz_partition_size / zero_quantized_weights / "
                          "zero_quantized_gradients in its zero_optimization block instead.")
    if zeropp and ds.zero_stage != "auto" and (problem := rules.zeropp_stage_problem(
            int(ds.zero_stage), f"deepspeed.{zeropp[0]} (ZeRO++)")):
        raise ConfigError(f"{problem} Set deepspeed.zero_stage to 3 (or auto).")


def check_data(cfg: TrainConfig) -> None:
    d = cfg.data
    if d.mode == "grpo" and cfg.grpo.rollouts:
        if d.sources:
            raise ConfigError("data.sources with grpo.rollouts: the recorded rollouts hold the "
                              "prompts; remove data.sources (or grpo.rollouts, to generate).")
        return
    if d.mode == "grpo" and d.validation_sources:
        raise ConfigError("data.validation_sources with data.mode=grpo: GRPO has no validation "
                          "loss (its completions are made while training); evaluate with the "
                          "eval: section instead.")
    if not d.sources:
        raise ConfigError("data.sources is empty: list data files (json/jsonl/parquet/txt), "
                          "globs, folders or hub dataset names.")
    if not 0.0 <= d.validation_split < 1.0:
        raise ConfigError(f"data.validation_split={d.validation_split} must be in [0, 1).")
    if d.pack and d.mode == "pretrain":
        raise ConfigError("data.pack applies to sft only (pretraining always packs; "
                          "data.reset_at_eod keeps its documents apart): remove it.")
    if d.reset_at_eod and d.mode != "pretrain":
        raise ConfigError(f"data.reset_at_eod applies to pretraining documents (data.mode="
                          f"{d.mode}); SFT examples are kept apart by data.pack: remove it.")
    if d.format != "auto" and d.mode == "pretrain":
        raise ConfigError(f"data.format={d.format} applies to sft only (pretraining reads "
                          "data.text_field): remove it or set data.mode=sft.")
    if not d.shuffle and d.mode == "pretrain":
        raise ConfigError("data.shuffle=false applies to sft only: pretraining reads megatron-core "
                          "GPTDataset's shuffled samples (seeded by train.seed).")
    if d.weights and d.mode != "pretrain":
        raise ConfigError("data.weights blends pretraining sources: remove it or set "
                          "data.mode=pretrain.")
    if d.mode in ROW_MODES and (d.pack or d.format != "auto"):
        key = "data.pack" if d.pack else f"data.format={d.format}"
        raise ConfigError(f"{key} applies to sft only (and distill, which reads SFT's rows): "
                          f"data.mode={d.mode} reads {ROW_MODES[d.mode]}: remove it.")
    from toolkit.train.data.pretrain import check_sources, check_weights

    try:
        check_weights(d.weights, d.sources)
        check_sources(d.sources + d.validation_sources, d.mode)  # headers and sizes, no scan
    except UserError as e:
        raise ConfigError(str(e)) from None


def check_dpo(cfg: TrainConfig) -> None:
    dpo_spec.check_settings(cfg.data.mode, cfg.dpo, DpoSection())
    if cfg.data.mode != "dpo":
        return
    if cfg.model.config:
        raise ConfigError("data.mode=dpo tunes a trained model: set model.path (the policy and, "
                          "unless dpo.reference names another, the reference) instead of "
                          "model.config.")
    if cfg.peft.method != "none" and cfg.dpo.reference and not cfg.dpo.precompute_reference:
        raise ConfigError(f"dpo.reference={cfg.dpo.reference!r} with peft.method="
                          f"{cfg.peft.method}: the reference is the policy with its adapters off "
                          "(model.path); remove dpo.reference or set "
                          "dpo.precompute_reference=true.")
    dpo_spec.check_reference(cfg.model.path, cfg.dpo.reference)


def check_post_training(cfg: TrainConfig) -> None:
    """The reward, kto and distill sections (``objectives.spec``)."""
    post_spec.check_sections(cfg, {"reward": RewardSection(), "kto": KtoSection(),
                                   "distill": DistillSection()})
    check = {"reward": post_spec.check_reward, "kto": post_spec.check_kto,
             "distill": post_spec.check_distill}.get(cfg.data.mode)
    if check is not None:
        check(cfg)


def check_grpo(cfg: TrainConfig) -> None:
    grpo_spec.check_grpo(cfg, GrpoSection())


def check_train(cfg: TrainConfig) -> None:
    t = cfg.train
    if (t.steps is None) == (t.epochs is None):
        raise ConfigError(f"set exactly one of train.steps and train.epochs; got steps={t.steps}, "
                          f"epochs={t.epochs}.")
    if t.epochs is not None and t.epochs <= 0:
        raise ConfigError(f"train.epochs={t.epochs} must be > 0.")
    if t.global_batch is not None and t.global_batch % t.micro_batch:
        raise ConfigError(f"train.global_batch={t.global_batch} is not a multiple of "
                          f"train.micro_batch={t.micro_batch}.")
    kernels.parse(t.fused_kernels)


def check_optim(cfg: TrainConfig) -> None:
    o, t = cfg.optim, cfg.train
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} is larger than optim.lr={o.lr}.")
    if t.steps is not None and o.warmup_steps > t.steps:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} exceeds train.steps={t.steps}.")
    if not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)}: each must be in [0, 1).")


def check_checkpoint(cfg: TrainConfig) -> None:
    c = cfg.checkpoint
    if c.resume not in ("auto", "none") and not Path(c.resume).is_dir():
        raise ConfigError(f"checkpoint.resume={c.resume!r}: not 'auto', 'none' or an existing "
                          "checkpoint folder.")


def check_peft(cfg: TrainConfig) -> None:
    p = cfg.peft
    if p.method == "none":
        if p.adapter or cfg.export.adapter_dir:
            raise ConfigError("peft.adapter / export.adapter_dir need peft.method=lora or dora.")
        return
    if not cfg.model.path:
        raise ConfigError(f"peft.method={p.method} fine-tunes adapters on a trained model: set "
                          "model.path (an HF folder or hub id), not model.config.")
    if p.dropout >= 1.0:
        raise ConfigError(f"peft.dropout={p.dropout} must be in [0, 1).")
    if p.target_modules is not None and not p.target_modules:
        raise ConfigError("peft.target_modules is empty: name projections (q_proj, ...) or set "
                          "it to null for every linear layer of the blocks.")
    from toolkit.lora import LoraError
    from toolkit.lora.peft_io import read_config
    from toolkit.lora.targets import model_projections

    targets = p.target_modules
    try:
        if p.adapter:
            spec, _ = read_config(p.adapter)
            if spec.method != p.method:
                raise ConfigError(f"peft.adapter {p.adapter} is a {spec.method} adapter but "
                                  f"peft.method={p.method}: set peft.method={spec.method}.")
            targets = sorted(spec.targets)
        from toolkit.adapters.spec import ModelSpec, has_config

        if has_config(cfg.model.path):  # a local model: its family says which targets exist
            from toolkit.lora import LoraSpec

            model_projections(ModelSpec.of(Path(cfg.model.path)).config,
                              LoraSpec(r=p.r, targets=frozenset(targets or ())))
    except LoraError as e:
        raise ConfigError(f"peft: {e}") from None


def check_logging(cfg: TrainConfig) -> None:
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true but wandb is not installed: `pip install wandb` or "
                          "set logging.wandb=false.")
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true but tensorboard is not installed: `pip install "
                          "tensorboard` or set logging.tensorboard=false.")


def check_eval(cfg: TrainConfig) -> None:
    """The eval section's files exist and its tasks are lm-eval's (or under include_path)."""
    e = cfg.eval
    if e.samples and not Path(e.samples).is_file():
        raise ConfigError(f"eval.samples={e.samples}: no such prompts file (JSON lines with "
                          "'prompt' or 'messages').")
    if e.tasks:
        from toolkit.infer.run import check_tasks

        try:
            check_tasks(list(e.tasks), e.include_path)
        except UserError as err:
            raise ConfigError(f"eval.tasks: {err}") from None
    elif e.include_path:
        raise ConfigError("eval.include_path without eval.tasks: name the tasks to run.")


CHECKS: tuple[Callable[[TrainConfig], None], ...] = (
    check_output_dir, check_model, check_parallel, check_deepspeed, check_data, check_dpo,
    check_post_training, check_grpo, check_train, check_optim, check_checkpoint, check_peft,
    check_logging,
    check_eval,
)


def validate(cfg: TrainConfig) -> None:
    """Every check of ``CHECKS``, in order; raises the first ConfigError."""
    for check in CHECKS:
        check(cfg)
