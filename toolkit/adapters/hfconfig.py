"""HF ``config.json`` without transformers: an attribute view, and translations families share.

``HFConfig`` reads like a transformers config (``cfg.hidden_size``, ``getattr(cfg, "head_dim",
None)``) but is a plain view over the JSON dict, so reading a checkpoint's config costs no torch or
transformers import (``mdtk estimate``, ``ds-config``, ``inspect``). Families read both this view
and real transformers configs through the same attribute access. The file itself is read and
written by ``toolkit.adapters.spec`` only.

The translations (RoPE, sliding windows, HF's dense-layer rule of MoE models) are written once
here for every family whose HF config uses the same keys, and so are the JSON types a key may
have (``Kind``; ``check_fields``): each family declares its keys' types (``Family.fields``) and
checks them before it reads a size, so a wrong type is one ``HFConfigError`` naming the file,
the key, the value and the type, whichever command reads the config.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.checkpoint.hf import CONFIG
from toolkit.checkpoint.torchfree import dtypes
from toolkit.errors import UserError


class UnsupportedModel(UserError):
    """An HF architecture or config feature megatron-core (or mdtk) cannot represent."""


class HFConfigError(UserError):
    """A config.json that cannot be read (missing, not JSON, not an object); names the path."""


class HFConfig:
    """Read-only attribute view over an HF ``config.json`` dict.

    Missing keys raise AttributeError, so ``getattr(cfg, key, default)`` and ``hasattr`` behave as
    on transformers configs. Sub-configs (keys ending in ``_config``, e.g. ``text_config``) come
    back as HFConfig views; other nested objects (``rope_scaling``) stay dicts, as in transformers.
    """

    __slots__ = ("_data", "_origin")

    def __init__(self, data: Mapping[str, Any], origin: str | Path | None = None) -> None:
        if not isinstance(data, Mapping):
            raise HFConfigError(f"an HF config is a JSON object, got {type(data).__name__}.")
        object.__setattr__(self, "_data", dict(data))
        object.__setattr__(self, "_origin", str(origin) if origin else None)

    def __getattr__(self, name: str) -> Any:
        data = object.__getattribute__(self, "_data")
        if name not in data:
            raise AttributeError(f"HF config has no {name!r}")
        value = data[name]
        if name.endswith("_config") and isinstance(value, Mapping):
            return HFConfig(value, self._origin)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("HFConfig is read-only; build a new one from to_dict().")

    def __contains__(self, name: object) -> bool:
        return name in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFConfig) and self._data == other._data

    def __hash__(self) -> int:
        return hash(json.dumps(self._data, sort_keys=True, default=str))

    def __reduce__(self) -> tuple[Any, ...]:
        return HFConfig, (self._data, self._origin)  # pickled by value (worker processes)

    def __repr__(self) -> str:
        return f"HFConfig({self._data!r})"

    def get(self, name: str, default: Any = None) -> Any:
        """The value of ``name`` when present and not null, else ``default``."""
        value = self._data.get(name)
        return default if value is None else value

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the underlying JSON dict."""
        return copy.deepcopy(self._data)

    def origin(self) -> str:
        """The file this view was read from, for error messages (config.json if unknown)."""
        return self._origin or CONFIG


# -- the JSON types of config keys -----------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """The JSON type (and range) a config key must have; ``what`` names it in the error."""

    what: str
    test: Callable[[Any], bool]


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


SIZE = Kind("a positive integer", lambda x: _integer(x) and x > 0)
COUNT = Kind("a non-negative integer", lambda x: _integer(x) and x >= 0)
NUMBER = Kind("a finite number", lambda x: (_integer(x) or isinstance(x, float))
              and math.isfinite(x))
FLAG = Kind("true or false", lambda x: isinstance(x, bool))
TEXT = Kind("a string", lambda x: isinstance(x, str))
# a dict, or the view / config object a reader made of one (``*_config`` keys)
OBJECT = Kind("a JSON object", lambda x: not isinstance(x, (str, int, float, list)))
TEXTS = Kind("a list of strings", lambda x: isinstance(x, list)
             and all(isinstance(i, str) for i in x))
COUNTS = Kind("a list of non-negative integers", lambda x: isinstance(x, list)
              and all(COUNT.test(i) for i in x))

#: What mdtk reads of every config before a family is chosen.
IDENTITY = {"architectures": TEXTS, "model_type": TEXT}


def declared_dtype(hf: Any) -> dtypes.DType:
    """The dtype an HF config declares for its weights (float32 when it declares none)."""
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    try:
        return dtypes.of(dtype) if dtype else dtypes.FLOAT32
    except ValueError as err:
        raise HFConfigError(f"{origin_of(hf)}: {err}") from None


def origin_of(hf: Any) -> str:
    """The file an HF config came from, for messages (a transformers config: config.json)."""
    return hf.origin() if isinstance(hf, HFConfig) else CONFIG


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "an integer" if isinstance(value, int) else "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), "a value")


def value_at(node: Any, key: str) -> Any:
    """The value of dotted ``key`` (``a.b``: key ``b`` of object ``a``) in a JSON dict or a
    config object; None where a step is missing or not an object."""
    for part in key.split("."):
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, (str, int, float, list)):
            return None
        else:  # HFConfig or a transformers config
            node = getattr(node, part, None)
        if node is None:
            return None
    return node


def wrong_types(node: Any, fields: Mapping[str, Kind]) -> list[tuple[str, Any, Kind]]:
    """(key, value, kind) of each key of ``fields`` present in ``node`` (not null) whose value
    has the wrong JSON type or range, in ``fields`` order."""
    found = ((key, value_at(node, key), kind) for key, kind in fields.items())
    return [(k, v, kind) for k, v, kind in found if v is not None and not kind.test(v)]


def wrong_type_text(key: str, value: Any, kind: Kind, reader: str) -> str:
    """``'hidden_size' is "64" (a string), but READER reads it as a positive integer``."""
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"{key!r} is {shown} ({_json_kind(value)}), but {reader} reads it as {kind.what}"


def check_fields(hf: Any, fields: Mapping[str, Kind], reader: str) -> None:
    """Refuse the first key of ``fields`` present in ``hf`` (not null) with the wrong JSON type:
    one ``HFConfigError`` naming the file, the key, its value and the type ``reader`` needs,
    before any arithmetic on it fails far away."""
    for key, value, kind in wrong_types(hf, fields)[:1]:
        raise HFConfigError(f"{origin_of(hf)}: {wrong_type_text(key, value, kind, reader)}: "
                            "correct that value.")


# -- translations shared by families ---------------------------------------------------------

# megatron-core 0.16.1 RotaryEmbedding._apply_scaling hard-codes these llama3 values; only
# ``factor`` is an argument (``rope_scaling_factor``).
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}


def rope_parameters(hf: Any) -> dict[str, Any]:
    """RoPE settings in transformers 5 form (``rope_parameters``), also from 4.x configs."""
    params = getattr(hf, "rope_parameters", None)
    if params:
        return dict(params)
    legacy = dict(getattr(hf, "rope_scaling", None) or {})
    if "type" in legacy and "rope_type" not in legacy:
        legacy["rope_type"] = legacy.pop("type")
    return {"rope_theta": getattr(hf, "rope_theta", 10000.0), "rope_type": "default", **legacy}


def rope_kwargs(hf: Any) -> dict[str, Any]:
    """GPTModel RoPE arguments; refuse what megatron-core's RotaryEmbedding cannot compute."""
    p = rope_parameters(hf)
    kind = p.get("rope_type", "default")
    out: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": p["rope_theta"]}
    partial = p.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        out["rotary_percent"] = float(partial)
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "seq_len_interpolation_factor": float(p["factor"])}
    if kind == "llama3":
        wrong = {k: p.get(k) for k, v in _MEGATRON_LLAMA3.items() if float(p.get(k, -1)) != v}
        if wrong:
            raise UnsupportedModel(
                f"llama3 rope_parameters {wrong} differ from the values megatron-core's "
                f"RotaryEmbedding hard-codes ({_MEGATRON_LLAMA3}); only 'factor' can vary."
            )
        return {**out, "rope_scaling": True, "rope_scaling_factor": float(p["factor"])}
    raise UnsupportedModel(
        f"rope_type={kind!r} is not supported by megatron-core's GPTModel RoPE (supported: "
        "default, linear, llama3)."
    )


def window_kwargs(hf: Any) -> dict[str, Any]:
    """Sliding-window attention as megatron-core's ``window_size`` (+ per-layer switch).

    HF lets position q attend to k when ``q - k < sliding_window``; megatron-core's window
    ``(left, 0)`` allows ``q - k <= left``, hence ``left = sliding_window - 1``. Per-layer
    windows come from HF's ``layer_types`` (Qwen2's ``use_sliding_window`` +
    ``max_window_layers`` are resolved into it by transformers; older Gemma configs give
    ``sliding_window_pattern`` instead: every pattern-th layer is global).
    """
    size = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    pattern = getattr(hf, "sliding_window_pattern", None)  # Gemma 2/3 configs before layer_types
    if types is None and pattern:
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(hf.num_hidden_layers)]
    if not size:
        return {}
    if types is None:
        return {"window_size": (size - 1, 0)}
    flags = [t == "sliding_attention" for t in types]
    if not any(flags):
        return {}
    out: dict[str, Any] = {"window_size": (size - 1, 0)}
    if not all(flags):
        out["window_attn_skip_freq"] = [int(f) for f in flags]
    return out


def dense_layers(hf: Any, layers: int, experts: int) -> tuple[int, ...]:
    """Layers HF's MoE decoders build with a dense MLP. Qwen-MoE: layer i is sparse iff ``i not
    in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``; DeepSeek:
    the first ``first_k_dense_replace`` layers are dense (a config has one rule or the other)."""
    only = set(getattr(hf, "mlp_only_layers", None) or [])
    step = getattr(hf, "decoder_sparse_step", None) or 1
    first = getattr(hf, "first_k_dense_replace", None) or 0
    return tuple(i for i in range(layers)
                 if i < first or i in only or not (experts > 0 and (i + 1) % step == 0))


def mla_rope_kwargs(hf: Any) -> dict[str, Any]:
    """megatron-core ``MLATransformerConfig`` RoPE fields of a DeepSeek config's decoupled RoPE
    head (``default`` or ``yarn``); refuse what MLA's YarnRotaryEmbedding computes differently.

    HF's YaRN multiplies cos/sin by ``get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim)`` when both are set (else ``get_mscale(factor)``) and the softmax scale by
    ``get_mscale(factor, mscale_all_dim) ** 2``; megatron-core computes both from its ``mscale`` /
    ``mscale_all_dim`` the same way, and ``mscale_all_dim=0`` means 1 for the softmax scale.
    """
    p = rope_parameters(hf)
    kind = p.get("rope_type", "default")
    out: dict[str, Any] = {"rotary_base": float(p["rope_theta"])}
    if kind == "default":
        return {**out, "rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0,
                "mscale_all_dim": 0.0}
    if kind != "yarn":
        raise UnsupportedModel(f"rope_type={kind!r}: multi-latent attention supports default and "
                               "yarn RoPE (megatron-core's MLA rope_type 'rope' / 'yarn').")
    y = _yarn(hf, p)
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    bad = {k: p[k] for k in ("attention_factor",) if p.get(k) is not None}
    if p.get("truncate", True) is not True:
        bad["truncate"] = p["truncate"]
    if mscale_all and not mscale:
        bad["mscale"] = mscale  # HF then ignores mscale_all_dim for cos/sin, megatron-core not
    if bad:
        raise UnsupportedModel(f"yarn rope_parameters {bad}: megatron-core's YarnRotaryEmbedding "
                               "(MLA) has no such setting; supported: factor, mscale with "
                               "mscale_all_dim, beta_fast, beta_slow, original_max_position_"
                               "embeddings.")
    return {**out, "rope_type": "yarn", "rotary_scaling_factor": y["factor"],
            "original_max_position_embeddings": y["original"], "beta_fast": y["beta_fast"],
            "beta_slow": y["beta_slow"],
            "mscale": float(mscale) if mscale and mscale_all else 1.0,
            "mscale_all_dim": float(mscale_all or 0.0)}


def _yarn(hf: Any, p: dict[str, Any]) -> dict[str, Any]:
    """YaRN's factor, original context and ramp bounds as HF's ``_compute_yarn_parameters``
    reads them (a missing factor: the context ratio, as DeepSeek-V3 configs mean it)."""
    orig = p.get("original_max_position_embeddings") or hf.max_position_embeddings
    return {"factor": float(p.get("factor") or hf.max_position_embeddings / orig),
            "original": int(orig), "beta_fast": float(p.get("beta_fast") or 32),
            "beta_slow": float(p.get("beta_slow") or 1)}


def yarn_kwargs(hf: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """YaRN RoPE (``rope_type: yarn``, GPT-OSS) as megatron-core's ``GPTModel`` computes it:
    its arguments and the ``YarnTransformerConfig`` fields (``toolkit.models.yarn``); any other
    RoPE: ``rope_kwargs`` and no fields.

    Both libraries take the inverse frequencies from the same ramp (``truncate`` is megatron-
    core's ``correction_range_round_to_int``) and scale cos / sin by ``get_mscale(factor)``, or
    by ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` when both are set.
    Refused: an explicit ``attention_factor`` and partial rotation (megatron-core's YaRN turns
    the whole head)."""
    p = rope_parameters(hf)
    if p.get("rope_type") != "yarn":
        return rope_kwargs(hf), {}
    partial = p.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    bad = {k: p[k] for k in ("attention_factor",) if p.get(k) is not None}
    if partial not in (None, 1.0):
        bad["partial_rotary_factor"] = partial
    if bad:
        raise UnsupportedModel(f"yarn rope_parameters {bad}: megatron-core's GPTModel YaRN has "
                               "no such setting.")
    y, both = _yarn(hf, p), bool(p.get("mscale") and p.get("mscale_all_dim"))
    return ({"position_embedding_type": "yarn", "rotary_base": float(p["rope_theta"])},
            {"yarn_rotary_scaling_factor": y["factor"],
             "yarn_original_max_position_embeddings": y["original"],
             "yarn_beta_fast": y["beta_fast"], "yarn_beta_slow": y["beta_slow"],
             "yarn_mscale": float(p["mscale"]) if both else None,
             "yarn_mscale_all_dim": float(p["mscale_all_dim"]) if both else None,
             "yarn_correction_range_round_to_int": bool(p.get("truncate", True))})


def sigmoid_routing(hf: Any, value: Callable[[Any, str], Any], top_k: int) -> dict[str, Any]:
    """DeepSeek-V3's routing (also GLM-4.5's and Kimi K2's) as megatron-core's router arguments:
    sigmoid scores plus the ``e_score_correction_bias`` (the router's ``expert_bias``) choose
    the experts, group-limited (``n_group`` groups scored by their top-2 sum, ``topk_group``
    kept; megatron-core scores a group by its top ``top_k // topk_group``), the unbiased scores
    of the chosen experts renormalised, times ``routed_scaling_factor``; no auxiliary loss (HF
    has none). ``value(hf, key)``: the family's reading of a key (its defaults). Refuses the
    settings megatron-core cannot compute as HF does."""
    ok = {"norm_topk_prob": value(hf, "norm_topk_prob") or top_k == 1,
          "topk_group": value(hf, "n_group") == 1 or top_k // value(hf, "topk_group") == 2,
          "scoring_func": getattr(hf, "scoring_func", "sigmoid") == "sigmoid",
          "topk_method": getattr(hf, "topk_method", "noaux_tc") == "noaux_tc"}
    if bad := {k: getattr(hf, k, None) for k, good in ok.items() if not good}:
        raise UnsupportedModel(f"routing {bad}: megatron-core's router cannot compute this as HF "
                               "does (sigmoid scores with score-correction bias, renormalised "
                               "top-k, groups scored by their top-2 experts).")
    return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_pre_softmax": False,
            "moe_router_topk_scaling_factor": float(value(hf, "routed_scaling_factor")),
            "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
            "moe_router_num_groups": value(hf, "n_group"),
            "moe_router_group_topk": value(hf, "topk_group")}


def config_text(config: Mapping[str, Any] | HFConfig, dtype: Any = None) -> str:
    """A config as the JSON mdtk writes (keys sorted). With ``dtype`` (the weights' dtype):
    ``dtype`` (and the older ``torch_dtype``, when present) set to it and the fp8
    ``quantization_config`` dropped (the weights written are not quantized): what a conversion
    writes, without importing transformers (~2 s: its config classes pull in torch._dynamo)."""
    data = config.to_dict() if isinstance(config, HFConfig) else copy.deepcopy(dict(config))
    if dtype is not None:
        name = dtypes.name_of(dtype) or str(dtype).removeprefix("torch.")
        data["dtype"] = name
        data.pop("quantization_config", None)
        if "torch_dtype" in data:
            data["torch_dtype"] = name
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
