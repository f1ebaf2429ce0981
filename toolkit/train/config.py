"""The training YAML schema: small dataclasses, typed ``key.path=value`` overrides, validation.

One schema serves three jobs: it types the values read from YAML and from the command line (so
``optim.lr=3e-4`` is a float even though YAML 1.1 reads it as a string), it rejects unknown keys
with a did-you-mean, and it states every allowed value in one place. Everything is checked before
any process group, model or dataset is built, so a typo costs seconds, not a queued cluster job.

Key names are fixed by the project's CLI contract (scripts override them):
``output_dir``; ``parallel.tp/pp/vpp/cp/ep/etp/sequence_parallel``; ``deepspeed.zero_stage/
offload/config``; ``train.steps/epochs/micro_batch/global_batch/seq_len/seed/precision/recompute/
eval_interval``; ``optim.*``; ``checkpoint.*``; ``export.hf_dir``; ``logging.*``.
A value ``bundled:REL`` names a file that ships inside mdtk (``toolkit/bundled/REL``), e.g. the
demo data ``bundled:examples/data/sft.jsonl``; it is resolved to that file's path on load.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit import bundled
from toolkit.errors import ConfigError
from toolkit.parallel.layout import LayoutError, ParallelLayout
from toolkit.train.data import MODES, SFT_FORMATS


def _opt(default: Any = None, *, choices: Sequence[Any] | None = None, minimum: float | None = None,
         factory: Any = None) -> Any:
    meta = {"choices": tuple(choices) if choices else None, "min": minimum}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# -- sections ----------------------------------------------------------------------------------
@dataclass
class ModelSection:
    """``path``: HF folder or hub id to fine-tune. ``config``: an HF config (config.json, a folder
    holding one, or a preset name) to pretrain from scratch. ``tokenizer`` defaults to ``path``."""

    path: str | None = None
    config: str | None = None
    tokenizer: str | None = None


@dataclass
class ParallelSection:
    tp: int = _opt(1, minimum=1)
    pp: int = _opt(1, minimum=1)
    vpp: int | None = _opt(None, minimum=1)
    cp: int = _opt(1, minimum=1)
    ep: int = _opt(1, minimum=1)
    etp: int | None = _opt(None, minimum=1)
    sequence_parallel: bool = False

    def layout(self) -> ParallelLayout:
        """The unresolved layout (dp inferred later by ``ParallelLayout.resolve``)."""
        return ParallelLayout(tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep,
                              etp=self.etp, sequence_parallel=self.sequence_parallel)


@dataclass
class DeepSpeedSection:
    """``config: auto`` builds the DeepSpeed JSON with the project's generator from
    ``zero_stage``/``offload`` (``auto`` there lets the generator choose from its memory model);
    a path uses the user's JSON (linted by the generator's check first).
    ``offload``: cpu/nvme moves optimizer states (ZeRO >= 1); at ZeRO-3 the generator also moves
    the parameters there only when the optimizer alone does not make the run fit."""

    zero_stage: int | str = _opt(1, choices=(0, 1, 2, 3, "auto"))
    offload: str = _opt("none", choices=("none", "cpu", "nvme", "auto"))
    nvme_path: str | None = None
    config: str = "auto"


@dataclass
class DataSection:
    """Sources are local json/jsonl/parquet/text files (globs and folders too) or hub dataset
    names. ``pretrain`` packs documents into seq_len+1 blocks; ``sft`` trains on responses only.
    ``format`` (sft only): ``auto`` detects each row's format from its keys (messages,
    prompt_response, alpaca, sharegpt; see docs/training.md), a name forces it for every row.
    ``template``: ``chat`` renders rows through the tokenizer's chat template, ``plain`` joins
    prompt + response + EOS, ``auto`` uses the chat template when the tokenizer has one.
    ``pack`` (sft only): several examples per sequence instead of one padded example."""

    mode: str = _opt("sft", choices=tuple(MODES))
    format: str = _opt("auto", choices=("auto", *SFT_FORMATS))
    sources: list[str] = _opt(factory=list)
    validation_sources: list[str] = _opt(factory=list)
    validation_split: float = _opt(0.05, minimum=0.0)
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    conversations_field: str = "conversations"
    template: str = _opt("auto", choices=("auto", "chat", "plain"))
    pack: bool = False
    shuffle: bool = True
    cache_dir: str | None = None
    num_proc: int = _opt(1, minimum=1)


@dataclass
class OptimSection:
    """AdamW (DeepSpeed's CPU Adam when offloading). ``clip_grad: 0`` turns clipping off."""

    lr: float = _opt(1e-4, minimum=0.0)
    min_lr: float = _opt(0.0, minimum=0.0)
    warmup_steps: int = _opt(0, minimum=0)
    decay: str = _opt("cosine", choices=("cosine", "linear", "constant"))
    weight_decay: float = _opt(0.0, minimum=0.0)
    clip_grad: float = _opt(1.0, minimum=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = _opt(1e-8, minimum=0.0)


@dataclass
class TrainSection:
    """Exactly one of ``steps`` / ``epochs``. ``global_batch`` defaults to micro_batch * dp
    (no gradient accumulation). ``eval_interval: 0`` evaluates only at the end;
    ``eval_batches`` caps the validation global batches per evaluation (None: all)."""

    steps: int | None = _opt(None, minimum=1)
    epochs: float | None = _opt(None, minimum=0.0)
    micro_batch: int = _opt(1, minimum=1)
    global_batch: int | None = _opt(None, minimum=1)
    seq_len: int = _opt(512, minimum=2)
    seed: int = _opt(1234, minimum=0)
    precision: str = _opt("bf16", choices=("bf16", "fp16", "fp32"))
    recompute: str = _opt("none", choices=("none", "selective", "full"))
    eval_interval: int = _opt(0, minimum=0)
    eval_batches: int | None = _opt(None, minimum=1)


@dataclass
class CheckpointSection:
    """``dir`` defaults to ``{output_dir}/checkpoints``; ``interval: 0`` saves only at the end;
    ``keep_last: 0`` keeps all; ``resume``: auto (latest complete, else start fresh) | none | a
    checkpoint folder."""

    dir: str | None = None
    interval: int = _opt(0, minimum=0)
    keep_last: int = _opt(2, minimum=0)
    resume: str = "auto"


@dataclass
class ExportSection:
    hf_dir: str | None = None
    verify: bool = True  # reload the export with transformers and compare its logits


@dataclass
class LoggingSection:
    """``peak_tflops`` overrides the per-device peak used for MFU (the table in metrics.py)."""

    interval: int = _opt(1, minimum=1)
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str | None = None
    peak_tflops: float | None = _opt(None, minimum=0.0)


@dataclass
class RuntimeSection:
    """``heartbeat_timeout_s``: a rank that completes no step (or checkpoint save) for this long
    is ended, so a hung collective fails the group fast (0: off). Set it above the longest step
    plus checkpoint save of the run."""

    heartbeat_timeout_s: float = _opt(1800.0, minimum=0.0)


@dataclass
class TrainConfig:
    output_dir: str | None = None
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    export: ExportSection = field(default_factory=ExportSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(str(self.output_dir)) / "checkpoints")

    @property
    def data_cache_dir(self) -> Path:
        return Path(self.data.cache_dir or Path(str(self.output_dir)) / "data_cache")

    @property
    def tokenizer_path(self) -> str:
        return str(self.model.tokenizer or self.model.path)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-safe dict (tuples become lists); ``config_from_dict`` reads it back."""
        return _plain(dataclasses.asdict(self))


# -- typing of values --------------------------------------------------------------------------
_NULLS = ("null", "~", "None")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML or from a command-line string) to the schema type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value in _NULLS):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{key}={value!r}: expected {_type_name(tp)}")
    if value is None:
        raise ConfigError(f"{key} must not be null: give a {_type_name(tp)}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
            return value.lower() in ("true", "yes", "on")
        raise ConfigError(f"{key}={value!r}: expected true or false.")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected an integer, not a boolean.")
        if isinstance(value, int):
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected an integer.") from None
        if not number.is_integer():
            raise ConfigError(f"{key}={value!r}: expected an integer.")
        return int(number)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a number, not a boolean.")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a number (e.g. 3e-4).") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r}: expected a single string.")
        return str(value)
    if origin is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(items)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r}: expected a list of {len(args)} values, "
                              f"e.g. [0.9, 0.95].")
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in pairs)
    raise TypeError(f"schema type {tp!r} of {key} is not handled")  # a bug in this module


def _check_field(value: Any, f: dataclasses.Field, key: str) -> None:
    choices, minimum = f.metadata.get("choices"), f.metadata.get("min")
    if choices and value not in choices:
        allowed = ", ".join(str(c) for c in choices)
        raise ConfigError(f"{key}={value!r} is not allowed: choose one of {allowed}.")
    if minimum is not None and value is not None and value < minimum:
        raise ConfigError(f"{key}={value!r} must be >= {minimum}.")


def _unknown(key: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.split(".")[-1], known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown key '{key}' in {where}.{hint} Known keys: {', '.join(known)}.")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"'{prefix or 'the config'}' must be a mapping of keys, got {raw!r}.")
    fields, hints = _fields(cls), _hints(cls)
    where = f"section '{prefix}'" if prefix else "the top level"
    values = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise _unknown(key, list(fields), where)
        tp = hints[name]
        if _is_section(tp):
            values[name] = _build(tp, value, key)
        else:
            values[name] = _coerce(value, tp, key)
            _check_field(values[name], fields[name], key)
    return cls(**values)


def _resolve_bundled(section: Any, prefix: str = "") -> None:
    """Replace each ``bundled:REL`` value (one string, or one item of a list) in place by the
    path of that file shipped inside mdtk, so the configs in the package work from any folder."""
    for f in dataclasses.fields(section):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(section, f.name)
        try:
            if dataclasses.is_dataclass(value):
                _resolve_bundled(value, key)
            elif isinstance(value, str):
                setattr(section, f.name, bundled.resolve(value))
            elif isinstance(value, list):
                setattr(section, f.name, [bundled.resolve(v) if isinstance(v, str) else v
                                          for v in value])
        except FileNotFoundError as e:
            raise ConfigError(f"{key}: {e}") from None


def config_from_dict(raw: Mapping[str, Any]) -> TrainConfig:
    """Build and validate a config from a YAML-loaded mapping (``bundled:`` names resolved)."""
    cfg = _build(TrainConfig, raw, "")
    _resolve_bundled(cfg)
    validate(cfg)
    return cfg


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` -> (["optim", "lr"], value typed by the schema)."""
    import yaml

    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value (e.g. train.steps=10).")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    cls: Any = TrainConfig
    for depth, name in enumerate(path):
        fields = _fields(cls)
        sub = ".".join(path[: depth + 1])
        if name not in fields:
            where = f"section '{'.'.join(path[:depth])}'" if depth else "the top level"
            raise _unknown(sub, list(fields), where)
        tp = _hints(cls)[name]
        if _is_section(tp):
            if depth == len(path) - 1:
                raise ConfigError(f"override {text!r} names the section '{sub}': give one of its "
                                  f"keys, e.g. {sub}.{next(iter(_fields(tp)))}=...")
            cls = tp
            continue
        if depth != len(path) - 1:
            raise ConfigError(f"override {text!r}: '{sub}' is a value, not a section.")
        if tp is str or typing.get_args(tp) == (str, type(None)):
            value: Any = raw  # strings are taken verbatim (paths, "none", "auto")
            if raw in _NULLS:
                value = None
        else:
            try:
                value = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                value = raw
        value = _coerce(value, tp, key)
        _check_field(value, fields[name], key)
        return path, value
    raise ConfigError(f"override {text!r} has an empty key.")


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``key.path=value`` applied (later ones win)."""
    out: dict[str, Any] = _plain(dict(raw))
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for name in path[:-1]:
            if not isinstance(node.get(name), dict):
                node[name] = {}
            node = node[name]
        node[path[-1]] = list(value) if isinstance(value, tuple) else value
    return out


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML file (a path or a ``bundled:`` name; defaults when ``path`` is None), apply
    the overrides, validate. Raises ConfigError naming the offending key."""
    import yaml

    raw: Any = {}
    if path is not None:
        try:
            p = Path(bundled.resolve(str(path)))
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
        if not p.is_file():
            examples = [n for n in bundled.shipped() if n.endswith(".yaml")]
            raise ConfigError(f"config file {str(p)!r} does not exist (the examples that ship "
                              f"with mdtk: {', '.join(examples)}).")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{p} must hold a mapping of sections, got {type(raw).__name__}.")
    return config_from_dict(apply_overrides(raw, overrides))


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


# -- cross-key validation ----------------------------------------------------------------------
def validate(cfg: TrainConfig) -> None:
    """Checks that involve several keys; per-key types, choices and minimums are checked while
    building. Paths that must already exist are checked here too."""
    if not cfg.output_dir:
        raise ConfigError("output_dir is required: set output_dir: runs/NAME (or output_dir=...).")
    m = cfg.model
    if bool(m.path) == bool(m.config):
        raise ConfigError("set exactly one of model.path (HF folder or hub id to fine-tune) and "
                          "model.config (HF config to pretrain from scratch); got "
                          f"path={m.path!r}, config={m.config!r}.")
    if m.config and not m.tokenizer:
        raise ConfigError("model.config (pretraining from scratch) needs model.tokenizer: a "
                          "tokenizer folder or hub id.")
    try:
        cfg.parallel.layout()
    except LayoutError as e:
        raise ConfigError(f"parallel: {e}") from None

    ds = cfg.deepspeed
    if ds.offload == "nvme" and not ds.nvme_path:
        raise ConfigError("deepspeed.offload=nvme needs deepspeed.nvme_path: a folder on a fast "
                          "local NVMe disk.")
    if ds.offload in ("cpu", "nvme") and ds.zero_stage == 0:
        raise ConfigError(f"deepspeed.offload={ds.offload} needs ZeRO: set deepspeed.zero_stage to "
                          "1, 2 or 3 (parameters are offloaded only at stage 3).")
    if ds.config != "auto" and not Path(ds.config).is_file():
        raise ConfigError(f"deepspeed.config={ds.config!r}: no such file; give a DeepSpeed JSON "
                          "or 'auto' to generate one.")

    d = cfg.data
    if not d.sources:
        raise ConfigError("data.sources is empty: list data files (json/jsonl/parquet/txt), "
                          "globs, folders or hub dataset names.")
    if not 0.0 <= d.validation_split < 1.0:
        raise ConfigError(f"data.validation_split={d.validation_split} must be in [0, 1).")
    if d.pack and d.mode == "pretrain":
        raise ConfigError("data.pack applies to sft only (pretraining always packs): remove it.")
    if d.format != "auto" and d.mode == "pretrain":
        raise ConfigError(f"data.format={d.format} applies to sft only (pretraining reads "
                          "data.text_field): remove it or set data.mode=sft.")

    t = cfg.train
    if (t.steps is None) == (t.epochs is None):
        raise ConfigError(f"set exactly one of train.steps and train.epochs; got steps={t.steps}, "
                          f"epochs={t.epochs}.")
    if t.epochs is not None and t.epochs <= 0:
        raise ConfigError(f"train.epochs={t.epochs} must be > 0.")
    if t.global_batch is not None and t.global_batch % t.micro_batch:
        raise ConfigError(f"train.global_batch={t.global_batch} is not a multiple of "
                          f"train.micro_batch={t.micro_batch}.")

    o = cfg.optim
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} is larger than optim.lr={o.lr}.")
    if t.steps is not None and o.warmup_steps > t.steps:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} exceeds train.steps={t.steps}.")
    if not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)}: each must be in [0, 1).")

    c = cfg.checkpoint
    if c.resume not in ("auto", "none") and not Path(c.resume).is_dir():
        raise ConfigError(f"checkpoint.resume={c.resume!r}: not 'auto', 'none' or an existing "
                          "checkpoint folder.")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true but wandb is not installed: `pip install wandb` or "
                          "set logging.wandb=false.")
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true but tensorboard is not installed: `pip install "
                          "tensorboard` or set logging.tensorboard=false.")


# -- derived run plan --------------------------------------------------------------------------
@dataclass(frozen=True)
class RunPlan:
    """What the config means for this world size: the resolved layout and the batch split."""

    layout: ParallelLayout
    micro_batch: int
    global_batch: int
    grad_accum: int

    @property
    def dp(self) -> int:
        return int(self.layout.dp or 1)


def plan(cfg: TrainConfig, world_size: int) -> RunPlan:
    """Resolve dp from the world size (``ParallelLayout.resolve``) and derive gradient
    accumulation = global_batch / (micro_batch * dp)."""
    try:
        layout = cfg.parallel.layout().resolve(world_size)
    except LayoutError as e:
        raise ConfigError(f"parallel: {e}") from None
    dp = int(layout.dp or 1)
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


def total_steps(cfg: TrainConfig, num_train_samples: int, global_batch: int) -> int:
    """``train.steps``, or the optimizer steps that cover ``train.epochs`` passes (rounded up)."""
    if cfg.train.steps is not None:
        return cfg.train.steps
    if num_train_samples < 1:
        raise ConfigError("the training set is empty: check data.sources and data.seq_len.")
    return max(1, -(-int(cfg.train.epochs * num_train_samples) // global_batch))
