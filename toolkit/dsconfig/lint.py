"""Lint a DeepSpeed config: DeepSpeed's own parser (errors in plain words) plus the settings it
accepts silently but that do not do what they say (see docs/memory-model.md, "Lint").
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit import rules
from toolkit.adapters.hfconfig import (
    COUNT,
    FLAG,
    NUMBER,
    OBJECT,
    SIZE,
    TEXT,
    Kind,
    wrong_type_text,
    wrong_types,
)
from toolkit.dsconfig import zeropp
from toolkit.parallel.layout import LayoutError, ParallelLayout, ResolvedLayout

# Keys HF Trainer / accelerate fill in when their value is "auto"
# (transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig). "auto" anywhere else is kept
# by nobody: at the top level DeepSpeed fails on it, inside a block it silently uses the default.
HF_AUTO_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "fp16.enabled", "bf16.enabled",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps",
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
})
# accelerate's DeepSpeedPlugin (with DummyOptim / DummyScheduler) fills the rest of HF_AUTO_KEYS,
# but not these: it takes only lr and weight_decay from DummyOptim ("optimizer.params.betas not
# found in kwargs"). The generator writes HF_ADAM_BETAS / HF_ADAM_EPS there instead of "auto".
HF_ONLY_AUTO_KEYS = frozenset({"optimizer.params.betas", "optimizer.params.eps"})
# TrainingArguments' adam_beta1, adam_beta2 and adam_epsilon defaults; the HF Trainer checks the
# config's values against TrainingArguments and names any mismatch.
HF_ADAM_BETAS = (0.9, 0.999)
HF_ADAM_EPS = 1e-8
# accelerate's DeepSpeedPlugin fills these too (from its own settings), the HF Trainer does not.
ACCELERATE_AUTO_KEYS = frozenset({"zero_optimization.stage3_gather_16bit_weights_on_model_save"})
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# What HF would write there; only used to let DeepSpeed's parser check the rest of the file.
_AUTO_PLACEHOLDER = {"fp16.enabled": False, "bf16.enabled": False, "optimizer.params.betas":
                     [0.9, 0.999], "zero_optimization.stage3_gather_16bit_weights_on_model_save":
                     False}
INT_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold", "stage3_max_live_parameters",
            "stage3_max_reuse_distance", "sub_group_size", "stage3_model_persistence_threshold")
_PAIR = Kind("a list of two numbers", lambda x: isinstance(x, list) and len(x) == 2
             and all(NUMBER.test(i) for i in x))
#: JSON types of keys DeepSpeed takes without checking them (its pydantic blocks check their
#: own): a wrong one would fail only in deepspeed.initialize or in the first step.
TYPES: dict[str, Kind] = {
    "train_batch_size": SIZE, "train_micro_batch_size_per_gpu": SIZE,
    "gradient_accumulation_steps": SIZE, "gradient_clipping": NUMBER, "steps_per_print": SIZE,
    "wall_clock_breakdown": FLAG, "prescale_gradients": FLAG, "gradient_predivide_factor": NUMBER,
    "zero_allow_untested_optimizer": FLAG, "zero_optimization": OBJECT, "bf16": OBJECT,
    "fp16": OBJECT, "optimizer": OBJECT, "optimizer.type": TEXT,
    "optimizer.params": OBJECT, "optimizer.params.lr": NUMBER, "optimizer.params.betas": _PAIR,
    "optimizer.params.eps": NUMBER, "optimizer.params.weight_decay": NUMBER,
    "scheduler": OBJECT, "scheduler.type": TEXT, "scheduler.params": OBJECT,
    "scheduler.params.warmup_min_lr": NUMBER, "scheduler.params.warmup_max_lr": NUMBER,
    "scheduler.params.warmup_num_steps": COUNT, "scheduler.params.total_num_steps": SIZE,
}
KNOWN_TOP = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "bf16", "fp16", "amp",
    "zero_optimization", "optimizer", "scheduler", "aio", "activation_checkpointing",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "prescale_gradients",
    "gradient_predivide_factor", "communication_data_type", "seq_parallel_communication_data_type",
    "data_types", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "checkpoint",
    "elasticity", "autotuning", "compression_training", "data_efficiency", "pipeline",
    "sparse_gradients", "memory_breakdown", "dump_state", "monitor_config", "nebula",
    "curriculum_learning", "eigenvalue", "progressive_layer_drop", "tensor_parallel",
    "gradient_accumulation_dtype", "torch_autocast", "compile", "disable_allgather",
    "sequence_parallel_size", "weight_quantization", "hybrid_engine", "zenflow",
    "use_data_before_expert_parallelism", "graph_harvesting", "timers", "load_universal_checkpoint",
    "use_node_local_storage", "fp16_master_weights_and_gradients", "bfloat16", "sparse_attention",
    "quantize_training", "expert_parallel_size",
})
KNOWN_OPTIMIZERS = ("adam", "adamw", "lamb", "onebitadam", "onebitlamb", "zerooneadam",
                    "adagrad", "lion", "muadam", "muadamw", "musgd", "muon", "sgd")
_BLOCK_NAMES = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
    "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
    "DeepSpeedBF16Config": "bf16", "DeepSpeedFP16Config": "fp16",
}


@dataclass
class LintReport:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def load_config(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}"
                         ) from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object, got {type(cfg).__name__}")
    return cfg


def _walk(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            yield path, v
            yield from _walk(v, path)


def _enabled(cfg: dict, key: str) -> bool:
    block = cfg.get(key)
    return isinstance(block, dict) and block.get("enabled") is True


def lint(cfg: dict[str, Any], *, world_size: int | None = None,
         layout: ParallelLayout | None = None, run_deepspeed: bool = True,
         gpus_per_node: int | None = None, runs_here: bool = False) -> LintReport:
    """Errors (the run fails or silently misbehaves) and warnings (probably unintended).
    ``gpus_per_node``: the cluster's, for hpZ's group size. ``runs_here``: the config is for a
    run on this machine (the trainer), so kernels it lacks are errors, not warnings; with
    ``run_deepspeed`` (imports DeepSpeed) the lint asks which kernels this machine has."""
    report = LintReport()
    layout = layout or ParallelLayout()
    resolved: ResolvedLayout | LayoutError | None = None  # resolved once, when the world is known
    if world_size is not None:
        try:
            resolved = layout.resolve(world_size)
        except LayoutError as e:
            resolved = e
    autos = [p for p, v in _walk(cfg) if v == "auto"]
    for path in autos:
        if path not in HF_AUTO_KEYS | ACCELERATE_AUTO_KEYS:
            report.errors.append(
                f'{path} = "auto": only HF Trainer/accelerate resolve "auto", and only for '
                f"{len(HF_AUTO_KEYS)} known keys; here DeepSpeed "
                + ("fails on it" if "." not in path else "silently uses its default")
                + ". Write the value.")
    if autos and not report.errors:
        report.warnings.append(f'"auto" values ({len(autos)}) are filled only when this file is '
                               "used through HF Trainer/accelerate, not with deepspeed.initialize.")
    _check_precision(cfg, report)
    zero = cfg.get("zero_optimization") or {}
    if isinstance(zero, dict):
        _check_zero(cfg, zero, layout, report)
        at = resolved if isinstance(resolved, ResolvedLayout) else layout
        errors, warnings = zeropp.findings(zero, at, world_size, gpus_per_node,
                                           zeropp.communication_dtype(cfg))
        report.errors += errors
        report.warnings += warnings
        if run_deepspeed and zeropp.quantized_of(zero) and zero.get("stage") == 3:
            _check_kernels(zeropp.quantized_of(zero), runs_here, report)
    _check_batch(cfg, resolved, report)
    _check_optimizer(cfg, zero if isinstance(zero, dict) else {}, report)
    _check_top_level(cfg, report)
    typed = [wrong_type_text(k, v, kind, "DeepSpeed") + ": correct that value."
             for k, v, kind in wrong_types(cfg, TYPES) if v != "auto"]
    report.errors += typed
    if run_deepspeed and not typed:  # its parser's own words on a wrong type are less clear
        report.errors.extend(deepspeed_errors(
            cfg, world_size=world_size,
            layout=resolved if isinstance(resolved, ResolvedLayout) else None))
    unique = list(dict.fromkeys(report.errors))  # and none that another one says in full
    report.errors = [e for e in unique if not any(o != e and o.startswith(e) for o in unique)]
    return report


def _check_precision(cfg: dict, report: LintReport) -> None:
    if _enabled(cfg, "fp16") and _enabled(cfg, "bf16"):
        report.errors.append("fp16.enabled and bf16.enabled are both true: choose one (bf16 on "
                             "Ampere or newer GPUs, fp16 with loss scaling otherwise).")


def _check_zero(cfg: dict, zero: dict, layout: ParallelLayout, report: LintReport) -> None:
    stage = zero.get("stage", 0)
    stage = stage if isinstance(stage, int) else -1
    off_opt = zero.get("offload_optimizer") or {}
    off_par = zero.get("offload_param") or {}
    dev_opt = off_opt.get("device", "none") if isinstance(off_opt, dict) else "none"
    dev_par = off_par.get("device", "none") if isinstance(off_par, dict) else "none"
    if "aio" in zero:
        report.errors.append('"aio" is inside zero_optimization: it belongs at the top level of '
                             "the config (DeepSpeed rejects it there).")
    if 0 <= stage <= 3:
        _check_offload(stage, dev_opt, dev_par, report)
    for name, block, dev in (("offload_optimizer", off_opt, dev_opt),
                             ("offload_param", off_par, dev_par)):
        if dev == "nvme" and not (isinstance(block, dict) and block.get("nvme_path")):
            report.errors.append(f"zero_optimization.{name}.device=nvme without nvme_path: "
                                 "DeepSpeed accepts it and fails later in initialize. Set "
                                 "nvme_path to a folder on a local NVMe drive.")
    if "nvme" in (dev_opt, dev_par) and "aio" not in cfg:
        report.warnings.append('NVMe offload without a top-level "aio" block: DeepSpeed uses '
                               "block_size 1 MiB, queue_depth 8, intra_op_parallelism 1.")
    aio = cfg.get("aio")
    if isinstance(aio, dict) and "thread_count" in aio:
        report.errors.append('aio.thread_count is not a DeepSpeed key (ignored silently): the '
                             'key is "intra_op_parallelism".')
    for key in INT_KEYS:
        value = zero.get(key)
        if isinstance(value, float):
            if value.is_integer():
                report.warnings.append(f"zero_optimization.{key}={value!r} is a float: write it "
                                       f"as the integer {int(value)}.")
            else:
                report.errors.append(f"zero_optimization.{key}={value!r} must be an integer: "
                                     f"DeepSpeed rejects fractions. Use {int(value)}.")
    clip = cfg.get("gradient_clipping", 1.0)  # DeepSpeed's default; "auto": HF fills it
    problem = rules.zero_with_pipeline(stage, layout.pp, clipping=not (
        isinstance(clip, (int, float)) and clip <= 0))
    if problem:
        report.errors.append(problem)
    for old in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
        if old in zero:
            report.warnings.append(f"zero_optimization.{old} is deprecated: use "
                                   "offload_optimizer / offload_param blocks.")


def _check_offload(stage: int, dev_opt: str, dev_par: str, report: LintReport) -> None:
    """The offload devices against the stage (``toolkit.rules.offload_problems``), each reason
    under the key it is about."""
    devices = {"offload_optimizer": dev_opt, "offload_param": dev_par}
    fixes = {"offload_param": "Use stage 3 or remove offload_param.",
             "offload_optimizer": 'Use stage 3 or device "cpu".' if dev_opt == "nvme" else
             "Use stage >= 1."}
    wanted = ["none" if d == "auto" else d for d in devices.values()]  # "auto": reported apart
    for key, reason in rules.offload_problems(stage, *wanted):
        report.errors.append(f"zero_optimization.{key}.device={devices[key]} at stage {stage}: "
                             f"{reason} {fixes[key]}")


def _check_kernels(keys: list[str], runs_here: bool, report: LintReport) -> None:
    from toolkit.runtime.ops import quantizer_missing

    missing = quantizer_missing()
    if missing is None:
        return
    text = (f"zero_optimization.{keys[0]} needs DeepSpeed's quantizer kernels (CUDA), and "
            f"this machine has none: {missing}.")
    if runs_here:
        report.errors.append(text + " Run it on GPUs, or drop the quantized options "
                             "(zero_hpz_partition_size alone is exact and runs anywhere).")
    else:
        report.warnings.append(text + " Fine if the config is for a GPU cluster; here "
                               "deepspeed.initialize would fail.")


def _check_batch(cfg: dict, layout: ResolvedLayout | LayoutError | None,
                 report: LintReport) -> None:
    """The batch identity at ``layout`` (None: the world is not known; a LayoutError: the
    layout does not fit the world)."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    values = [cfg.get(k) for k in keys]
    if layout is None or any(isinstance(v, str) for v in values):
        return
    if isinstance(layout, LayoutError):
        report.errors.append(str(layout))
        return
    dp, world_size = layout.dp_cp, layout.world_size
    batch, micro, gas = values
    for k, v in zip(keys, values, strict=True):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            report.errors.append(f"{k}={v!r} must be a positive integer.")
            return
    if batch is not None and micro is not None and gas is not None and batch != micro * gas * dp:
        report.errors.append(
            f"batch identity broken: train_batch_size={batch} != micro {micro} x accumulation "
            f"{gas} x data-parallel size {dp} (= world {world_size} / (tp*pp = "
            f"{layout.tp * layout.pp}), DeepSpeed's data-parallel group includes the cp ranks) = "
            f"{micro * gas * dp}.")
    elif batch is not None and micro is not None and gas is None and batch % (micro * dp):
        report.errors.append(f"train_batch_size={batch} is not divisible by micro {micro} x "
                             f"data-parallel size {dp}.")


def _check_optimizer(cfg: dict, zero: dict, report: LintReport) -> None:
    opt = cfg.get("optimizer")
    off_opt = zero.get("offload_optimizer")
    offload = isinstance(off_opt, dict) and off_opt.get("device", "none") not in ("none", "auto")
    if opt is None:
        if offload and cfg.get("zero_force_ds_cpu_optimizer", True) is not False:
            report.warnings.append(
                "optimizer offload without an optimizer block: the optimizer you pass to "
                "deepspeed.initialize must be DeepSpeedCPUAdam, else DeepSpeed raises (or set "
                '"zero_force_ds_cpu_optimizer": false and accept a slow step).')
        return
    if not isinstance(opt, dict):
        report.errors.append("optimizer must be an object with type and params.")
        return
    kind = str(opt.get("type", ""))
    if kind.lower() not in KNOWN_OPTIMIZERS:
        report.warnings.append(f"optimizer.type={kind!r} is not a DeepSpeed optimizer; "
                               "DeepSpeed will look it up in torch.optim at initialize.")
    elif offload and kind.lower() not in ("adam", "adamw", "adagrad", "lion"):
        report.errors.append(f"optimizer.type={kind} with optimizer offload: DeepSpeed's CPU "
                             "optimizers are Adam/AdamW, Adagrad and Lion.")
    params = opt.get("params") or {}
    if "max_grad_norm" in params:
        report.warnings.append("optimizer.params.max_grad_norm is ignored by DeepSpeed: use the "
                               "top-level gradient_clipping.")


def _check_top_level(cfg: dict, report: LintReport) -> None:
    for key in cfg:
        if key not in KNOWN_TOP:
            close = difflib.get_close_matches(key, sorted(KNOWN_TOP), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            report.warnings.append(f"unknown top-level key {key!r}: DeepSpeed ignores it{hint}.")


def _resolve_autos(cfg: dict[str, Any], world: float = 1) -> dict[str, Any]:
    """A copy where HF "auto" keys hold what HF Trainer/accelerate would write, so DeepSpeed can
    check everything else: the batch keys as they derive them (train batch = micro x
    accumulation x world), any other value a placeholder."""
    out = copy.deepcopy(cfg)
    auto_batch = [k for k in _BATCH_KEYS if out.get(k) == "auto"]
    for path in HF_AUTO_KEYS | ACCELERATE_AUTO_KEYS:
        node, *_ = [out]
        parts = path.split(".")
        for p in parts[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(parts[-1]) == "auto":
            node[parts[-1]] = _AUTO_PLACEHOLDER.get(path, 1)
    if "train_batch_size" in auto_batch:
        micro, gas = out.get("train_micro_batch_size_per_gpu", 1), out.get(
            "gradient_accumulation_steps", 1)
        if isinstance(micro, int) and isinstance(gas, int):
            out["train_batch_size"] = micro * gas * world
    if isinstance(out.get("zero_optimization"), dict):
        out["zero_optimization"].pop("aio", None)  # reported in plain words already
    return out


def deepspeed_world(cfg: dict[str, Any], world_size: int, layout: ResolvedLayout | None = None
                    ) -> float:
    """The data-parallel world DeepSpeedConfig checks the batch keys against on WORLD_SIZE ranks:
    with model parallelism the mpu's data-parallel size (dp x cp of the resolved ``layout``: the
    cp ranks of a dp rank join DeepSpeed's data-parallel group), else DeepSpeed's own rule (the
    world, divided by ``sequence_parallel_size`` when the config sets it: a float, as DeepSpeed
    does)."""
    if layout is not None and layout.model_parallel > 1:
        return layout.dp_cp
    sp = cfg.get("sequence_parallel_size")
    return world_size / sp if "sequence_parallel_size" in cfg and sp else world_size


def deepspeed_config_at(cfg: dict[str, Any], world: float):
    """``DeepSpeedConfig`` parsed as on a run whose data-parallel world is WORLD, without starting
    torch.distributed: DeepSpeed reads the world from its communication backend (1 before
    ``deepspeed.initialize``), so it is set right before the batch keys are derived."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class _AtWorld(DeepSpeedConfig):
        def _initialize_params(self, param_dict):  # runs after __init__ set world_size
            self.world_size = world
            super()._initialize_params(param_dict)

    return _AtWorld(cfg)


def deepspeed_errors(cfg: dict[str, Any], world_size: int | None = None,
                     layout: ResolvedLayout | None = None) -> list[str]:
    """Run DeepSpeed's own ``DeepSpeedConfig`` at WORLD_SIZE ranks and translate what it rejects.

    HF "auto" values are resolved as HF Trainer/accelerate would. Without WORLD_SIZE the batch
    keys are rescaled to one rank when all three are given (the identity then holds at some
    world; ``lint`` checks it when the world is known) and the missing ones derived at world 1.
    Never raises: every DeepSpeed error, removed keys included, becomes one plain sentence.
    """
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfigError

    world = 1 if world_size is None else deepspeed_world(cfg, world_size, layout)
    probe = _resolve_autos(cfg, world)
    if world_size is None:
        micro, gas = probe.get("train_micro_batch_size_per_gpu"), probe.get(
            "gradient_accumulation_steps")
        if isinstance(micro, int) and isinstance(gas, int) and "train_batch_size" in probe:
            probe["train_batch_size"] = micro * gas
    at = "" if world_size is None else f" at {world_size} ranks"
    try:
        deepspeed_config_at(probe, world)
    except pydantic.ValidationError as e:
        block = _BLOCK_NAMES.get(e.title, e.title)
        return [_plain(block, err) for err in e.errors()]
    except DeepSpeedConfigError as e:  # removed keys and other checks DeepSpeed words itself
        return [f"DeepSpeed rejects the config: {e}"]
    except AssertionError as e:
        hint = ""
        if not any(k in cfg for k in _BATCH_KEYS[:2]):
            hint = (' Give train_micro_batch_size_per_gpu (or "auto" when HF Trainer/accelerate '
                    "fills it).")
        elif "batch" in str(e).lower() and world_size is not None:
            hint = (f" DeepSpeed derives the missing batch keys from the data-parallel world "
                    f"({world:g}); give train_micro_batch_size_per_gpu and "
                    "gradient_accumulation_steps that fit it.")
        return [f"DeepSpeed rejects the config{at}: {e}.{hint}"]
    except (TypeError, ValueError, KeyError) as e:
        return [f"DeepSpeed cannot read the config ({type(e).__name__}: {e}); check the value "
                "types (numbers as numbers, not strings)."]
    except Exception as e:  # noqa: BLE001 - a plain message, never a traceback
        return [f"DeepSpeed cannot read the config ({type(e).__name__}: {e})."]
    return []


def _plain(block: str, err: dict[str, Any]) -> str:
    where = ".".join([block, *[str(x) for x in err.get("loc", ())]])
    value = err.get("input")
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return f"{where}: unknown key (DeepSpeed rejects it); check the spelling."
    if kind == "int_from_float":
        return f"{where}={value!r} must be an integer: DeepSpeed rejects fractions."
    if kind.startswith("int"):
        return f"{where}={value!r} must be an integer."
    if kind == "enum":
        return f"{where}={value!r} is not allowed: use one of {err['ctx']['expected']}."
    if kind.startswith("bool"):
        return f"{where}={value!r} must be true or false."
    if kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        return f"{where}={value!r} is out of range: {err.get('msg', '').lower()}."
    return f"{where}={value!r}: {err.get('msg', 'invalid')}."
