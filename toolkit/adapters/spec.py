"""One model description per command (``ModelSpec``), and the one module that reads and writes an
HF ``config.json``.

Each command makes one ``ModelSpec`` at its entry from what it was given (an HF folder, a
config.json, a hub id, a preset, a checkpoint's ``hf_config/`` folder, an already-read dict) and
passes it down, so the config is read once and the mapping built once per process: the parsed
config (``HFConfig``, torch-free; transformers' config object only where a model is built or
transformers' JSON is written, made on first use), the family, the shape (``ModelShape``) and the
mapping (``Adapter``, built on first use, once per dtype and vocab padding, cached here).

``read_hf_config`` and ``write_config`` are the only places a config.json is opened; with
``MDTK_MODEL_EVENTS=FILE`` every process (a converter's workers, a trainer's ranks) appends a
line to FILE for each config read and each mapping built, which is how the tests count them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from toolkit.adapters.family import Dims, Family
from toolkit.adapters.hfconfig import (
    HFConfig,
    HFConfigError,
    UnsupportedModel,
    config_text,
    declared_dtype,
)
from toolkit.adapters.presets import MODEL_PRESETS, get_preset
from toolkit.adapters.registry import family_of
from toolkit.adapters.shape import ModelShape
from toolkit.atomic import write_text
from toolkit.checkpoint.hf import CONFIG
from toolkit.checkpoint.torchfree import dtypes

#: A file that, when set, gets one ``PID EVENT DETAIL`` line per config read / mapping built.
EVENTS = "MDTK_MODEL_EVENTS"


def record(event: str, detail: str = "") -> None:
    """Note ``event`` (``read``: a config.json opened; ``mapping``: an ``Adapter`` built) in the
    file ``$MDTK_MODEL_EVENTS`` names; nothing when it is unset."""
    target = os.environ.get(EVENTS)
    if target:
        with open(target, "a") as f:
            f.write(f"{os.getpid()} {event} {detail}\n")


def read_events(file: str | Path) -> dict[int, dict[str, int]]:
    """The events ``record`` wrote to ``file``, counted per process: ``{pid: {event: n}}``."""
    out: dict[int, dict[str, int]] = {}
    text = Path(file).read_text() if Path(file).is_file() else ""
    for line in text.splitlines():
        pid, event = line.split()[:2]
        counts = out.setdefault(int(pid), {})
        counts[event] = counts.get(event, 0) + 1
    return out


# -- the file --------------------------------------------------------------------------------

def config_file(folder_or_file: str | Path) -> Path:
    """The config.json of an HF folder, or the file itself."""
    path = Path(folder_or_file)
    return path / CONFIG if path.is_dir() else path


def has_config(folder: str | Path) -> bool:
    """Whether ``folder`` holds a config.json."""
    return (Path(folder) / CONFIG).is_file()


def read_hf_config(folder_or_file: str | Path) -> HFConfig:
    """The ``config.json`` of an HF folder (or the file itself), parsed as plain JSON."""
    path = Path(folder_or_file)
    file = config_file(path)
    if not file.is_file():
        where = f"{path} holds no {CONFIG}" if path.is_dir() else f"{path} does not exist"
        raise HFConfigError(f"{where}: pass an HF model folder or its {CONFIG}.")
    record("read", str(file))
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConfigError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise HFConfigError(f"{file} holds a JSON {type(data).__name__}, not an object.")
    return HFConfig(data, file)


def write_config(folder: str | Path, config: Any, dtype: Any = None, *,
                 name: str = CONFIG) -> Path:
    """Write ``folder/config.json`` (atomically; ``name``: another file name, for a config kept
    beside other files): a JSON dict or ``HFConfig`` as ``config_text`` gives it, or a
    transformers config as its ``save_pretrained`` writes it (only the values that differ from
    its class's defaults)."""
    file = Path(folder) / name
    if isinstance(config, (Mapping, HFConfig)):
        write_text(file, config_text(config, dtype))
    elif name == CONFIG:
        config.save_pretrained(str(folder))
    else:
        raise ValueError(f"a transformers config is written as {CONFIG}, not {name}.")
    return file


@dataclass(frozen=True)
class ConfigFile:
    """The config.json an ``HFWriter`` writes at ``finish`` (which calls ``save_pretrained``),
    written by ``write_config``."""

    config: Any  # a JSON dict, an HFConfig or a transformers config
    dtype: Any = None

    def save_pretrained(self, folder: str | Path) -> None:
        write_config(folder, self.config, self.dtype)


# -- the description -------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class ModelSpec:
    """One model as a command uses it: made once at the command's entry and passed down.

    ``config`` is the config as read (plain JSON); ``source`` the local folder it came from
    (weights, tokenizer and generation config beside it), None for a dict, a preset or a hub
    config. ``live``: the model is built and run in megatron-core, so its mapping reads
    transformers' config object (the defaults a config.json may omit filled in as the HF model
    sees them); otherwise (conversions, inspect, estimates) the plain JSON and no transformers.
    Compared by identity; pickled without its caches (a converter's worker builds its mapping
    once from the config it is sent, reading no file).
    """

    config: HFConfig
    source: Path | None = None
    name: str = "model"
    live: bool = False
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, source: Any, *, live: bool = False, name: str = "model") -> ModelSpec:
        """The spec of ``source``: a ModelSpec (as is), an HF folder or config.json path, an
        ``HFConfig``, a JSON dict, or a transformers config object (then the live model's)."""
        if isinstance(source, ModelSpec):
            return source
        if isinstance(source, (str, Path)):
            path = Path(source)
            return cls(read_hf_config(path), path if path.is_dir() else None, name, live)
        if isinstance(source, HFConfig):
            return cls(source, None, name, live)
        if isinstance(source, Mapping):
            return cls(HFConfig(source), None, name, live)
        spec = cls(HFConfig(source.to_dict()), None, name, True)  # a transformers config
        spec._cache["transformers"] = source
        return spec

    @classmethod
    def named(cls, text: str) -> ModelSpec:
        """What ``--model`` names: a preset, a config.json or a folder holding one, or a hub id
        (its config.json only is fetched)."""
        if text.lower() in MODEL_PRESETS:
            return cls(HFConfig(get_preset(text)), name=text.lower())
        path = Path(text)
        if path.is_dir() or path.is_file():
            file = config_file(path)
            return cls(read_hf_config(path), path if path.is_dir() else None,
                       file.parent.name or str(file))
        if path.exists() or text.count("/") != 1:
            raise HFConfigError(
                f"model {text!r}: not a preset ({', '.join(sorted(MODEL_PRESETS))}), not a "
                f"{CONFIG} or a folder holding one, and not a hub id of the form owner/name")
        from huggingface_hub import hf_hub_download

        try:
            file = hf_hub_download(text, CONFIG)
        except Exception as e:  # network, authentication, missing repo: all say the same
            raise HFConfigError(f"could not fetch the config of hub model {text!r}: {e}") from e
        return cls(read_hf_config(file), name=text)

    def __getstate__(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**state, "_cache": {}}

    # -- what the config says --------------------------------------------------------------
    @property
    def raw(self) -> dict[str, Any]:
        """A deep copy of the config's JSON dict."""
        return self.config.to_dict()

    @cached_property
    def decoder(self) -> HFConfig:
        """The decoder's config: a multimodal config's ``text_config`` (tying from outside)."""
        hf = self.config
        text = getattr(hf, "text_config", None)
        if text is None or getattr(hf, "hidden_size", None) is not None:
            return hf
        tied = getattr(hf, "tie_word_embeddings", None)
        return HFConfig({**text.to_dict(), **({} if tied is None else
                                                {"tie_word_embeddings": tied})}, hf.origin())

    @cached_property
    def family(self) -> Family:
        return family_of(self.decoder)

    @cached_property
    def dims(self) -> Dims:
        return self.family.dims(self.decoder)

    @cached_property
    def shape(self) -> ModelShape:
        """The model's shape (without LoRA adapters: ``toolkit.memory.shape_of`` adds them)."""
        d = self.dims
        if min(d.hidden, d.heads, d.layers, d.groups) <= 0 or d.heads % d.groups:
            raise UnsupportedModel(
                f"inconsistent attention sizes: hidden_size={d.hidden}, num_attention_heads="
                f"{d.heads}, num_key_value_heads={d.groups} (heads must be a positive multiple "
                "of kv heads)")
        return dataclasses.replace(ModelShape.from_dims(d, self.name),
                                   cp_refusal=self.family.cp_refusal(self.decoder))

    @property
    def dtype(self) -> dtypes.DType:
        """The dtype the config declares for the weights (float32 when none)."""
        return declared_dtype(self.config)

    # -- what is made from it on first use -------------------------------------------------
    def transformers_config(self) -> Any:
        """transformers' config object of this model, as ``AutoConfig.from_pretrained`` makes
        it from the same JSON (made once; imports transformers)."""
        if "transformers" not in self._cache:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            model_type = self.transformers_type
            if model_type not in CONFIG_MAPPING:
                raise UnsupportedModel(f"{self.config.origin()}: model_type={model_type!r} is "
                                       "not a transformers model type.")
            made = CONFIG_MAPPING[model_type].from_dict(self.raw)
            if self.source is not None:
                made._name_or_path = str(self.source)
            self._cache["transformers"] = made
        return self._cache["transformers"]

    @property
    def transformers_type(self) -> str | None:
        """The model type whose transformers config class reads this config: its own, or the
        one its family names for a type transformers does not know (Kimi K2's ``kimi_k2``,
        published with remote code, is DeepSeek-V3's)."""
        model_type = self.config.get("model_type")
        try:
            types = self.family.transformers_types
        except UnsupportedModel:  # no family: transformers' own type, if it knows it
            return model_type
        return types.get(model_type, model_type)

    @property
    def foreign(self) -> bool:
        """transformers reads this config with another model type's class: write it back as
        read (its own remote code reads it), never as transformers would render it."""
        return self.transformers_type != self.config.get("model_type")

    def adapter(self, dtype: Any = None, vocab_multiple: int = 1, head: str = "lm") -> Any:
        """The mapping (``toolkit.adapters.Adapter``) with megatron-core parameters in ``dtype``
        (default: the declared one) and the vocab padded to ``vocab_multiple * tp``: built
        on first use, then the same object for the same dtype and padding. ``head="score"``: a
        reward model's (the same mapping with a scalar head in place of the LM head)."""
        key = ("adapter", dtypes.of(self.dtype if dtype is None else dtype).name, vocab_multiple)
        if head != "lm":  # (an HF sequence-classification folder's own mapping has it)
            scored = (*key, head)
            if scored not in self._cache:
                base = self.adapter(dtype, vocab_multiple)
                self._cache[scored] = base if base.head == head else base.with_score_head()
            return self._cache[scored]
        if key not in self._cache:
            from toolkit.adapters.adapter import bind, family_for_config

            hf = self.config
            if self.live:  # mdtk's checks (types named by key) first, on the plain JSON:
                family_for_config(hf).check(hf)  # transformers' own would raise a traceback
                hf = self.transformers_config()
            self._cache[key] = bind(hf, self.source, dtype, vocab_multiple)
            if self.foreign:
                self._cache[key].written_config = self.config
            record("mapping", type(self._cache[key].family).__name__)
        return self._cache[key]

    def write(self, folder: str | Path, dtype: Any = None) -> Path:
        """``folder/config.json``: the config as read (``dtype``: see ``config_text``)."""
        return write_config(folder, self.config, dtype)


def adapter_for(config_or_path: Any, *, dtype: Any = None, vocab_multiple: int = 1) -> Any:
    """The mapping (``Adapter``) of an HF config, or of a folder read into a live spec: for
    tests and scripts; a command passes its one ``ModelSpec`` and asks ``spec.adapter``.

    ``dtype`` is megatron-core's parameter dtype; by default the checkpoint's own dtype.
    Raises UnsupportedModel (listing the supported architectures) for unknown families.
    """
    live = isinstance(config_or_path, (str, Path))
    return ModelSpec.of(config_or_path, live=live).adapter(dtype, vocab_multiple)


def load_hf_config(path: str | Path) -> Any:
    """transformers' own config object of a local folder's config.json."""
    return ModelSpec.of(path, live=True).transformers_config()
