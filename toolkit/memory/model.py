"""A transformer's shape, read from an HF config, and its exact list of parameter tensors.

Everything the memory model needs about a model is here. Parameter counts are derived from the
list of tensors (not from a closed formula) so that per-rank counts under tensor/pipeline/expert
parallelism and ZeRO-3's persistence threshold are computed from the same source of truth.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """An HF config the memory model cannot read; the message names the key."""


# How a tensor is split across ranks (megatron-core convention).
COL, ROW, REP, VOCAB, EXPERT = "col", "row", "rep", "vocab", "expert"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    numel: int
    split: str  # COL / ROW / REP / VOCAB / EXPERT
    layer: int | None  # decoder layer index, None for embedding / final norm / head


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer (Llama, Qwen2/3, Mistral, Mixtral, Qwen2-MoE, GPT-2)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    gated_mlp: bool = True
    norm: str = "rms"  # "rms" (weight only) or "layer" (weight + bias)
    qk_norm: bool = False
    learned_positions: int = 0  # rows of a learned position embedding (GPT-2), 0 for RoPE
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    shared_gate: bool = False
    moe_layers: tuple[int, ...] = ()
    name: str = "model"

    # -- derived -----------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def padded_vocab(self, tp: int, multiple: int = 128) -> int:
        """megatron-core pads the vocabulary to a multiple of ``multiple * tp``."""
        step = multiple * tp
        return -(-self.vocab // step) * step

    def tensors(self, *, vocab: int | None = None) -> Iterator[TensorSpec]:
        """Every parameter tensor of the HF model, with how megatron-core splits it."""
        h, v = self.hidden, vocab or self.vocab
        norm_n = 2 if self.norm == "layer" else 1
        yield TensorSpec("embed", v * h, VOCAB, None)
        if self.learned_positions:
            yield TensorSpec("pos_embed", self.learned_positions * h, REP, None)
        for i in range(self.layers):
            yield from self._layer_tensors(i, norm_n)
        yield TensorSpec("final_norm", norm_n * h, REP, None)
        if not self.tied:
            yield TensorSpec("lm_head", v * h, VOCAB, None)

    def _layer_tensors(self, i: int, norm_n: int) -> Iterator[TensorSpec]:
        h = self.hidden
        for k in range(norm_n):
            yield TensorSpec(f"l{i}.input_norm.{k}", h, REP, i)
        yield TensorSpec(f"l{i}.q", h * self.q_dim, COL, i)
        yield TensorSpec(f"l{i}.k", h * self.kv_dim, COL, i)
        yield TensorSpec(f"l{i}.v", h * self.kv_dim, COL, i)
        if self.qkv_bias:
            yield TensorSpec(f"l{i}.qkv_bias", self.q_dim + 2 * self.kv_dim, COL, i)
        yield TensorSpec(f"l{i}.o", self.q_dim * h, ROW, i)
        if self.o_bias:
            yield TensorSpec(f"l{i}.o_bias", h, REP, i)
        if self.qk_norm:
            yield TensorSpec(f"l{i}.q_norm", self.head_dim, REP, i)
            yield TensorSpec(f"l{i}.k_norm", self.head_dim, REP, i)
        for k in range(norm_n):
            yield TensorSpec(f"l{i}.post_norm.{k}", h, REP, i)
        if self.is_moe_layer(i):
            yield TensorSpec(f"l{i}.router", self.experts * h, REP, i)
            yield TensorSpec(f"l{i}.experts", self.experts * self._mlp_numel(self.moe_ffn),
                             EXPERT, i)
            if self.shared_ffn:
                yield from self._mlp_tensors(f"l{i}.shared", self.shared_ffn, i)
            if self.shared_gate:
                yield TensorSpec(f"l{i}.shared_gate", h, REP, i)
        else:
            yield from self._mlp_tensors(f"l{i}.mlp", self.ffn, i)

    def _mlp_numel(self, ffn: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * ffn

    def _mlp_tensors(self, prefix: str, ffn: int, i: int) -> Iterator[TensorSpec]:
        h = self.hidden
        n_in = 2 if self.gated_mlp else 1
        yield TensorSpec(f"{prefix}.fc1", n_in * h * ffn, COL, i)
        yield TensorSpec(f"{prefix}.fc2", ffn * h, ROW, i)
        if self.mlp_bias:
            yield TensorSpec(f"{prefix}.fc1_bias", n_in * ffn, COL, i)
            yield TensorSpec(f"{prefix}.fc2_bias", h, REP, i)

    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors())

    def active_params(self) -> int:
        """Parameters one token passes through (MoE: top-k of the experts)."""
        total = 0
        for t in self.tensors():
            total += t.numel * self.top_k // self.experts if t.split == EXPERT else t.numel
        return total

    def layer_params(self, layer: int) -> int:
        return sum(t.numel for t in self._layer_tensors(layer, 2 if self.norm == "layer" else 1))


def _get(cfg: dict[str, Any], *keys: str, default: Any = None, required: bool = True) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is None and required:
        raise ModelConfigError(
            f"config has none of {', '.join(repr(k) for k in keys)}: the memory model needs it "
            "(is this a decoder-only transformer config.json?)"
        )
    return default


def model_shape_from_hf(cfg: dict[str, Any], name: str = "model") -> ModelShape:
    """Read an HF ``config.json`` dict (Llama, Mistral, Qwen2/3, Mixtral, Qwen2-MoE, GPT-2)."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings")}
    model_type = cfg.get("model_type", "")
    if model_type == "gpt2":
        h = _get(cfg, "n_embd", "hidden_size")
        heads = _get(cfg, "n_head", "num_attention_heads")
        return ModelShape(
            hidden=h, layers=_get(cfg, "n_layer", "num_hidden_layers"), heads=heads,
            kv_heads=heads, head_dim=h // heads, ffn=cfg.get("n_inner") or 4 * h,
            vocab=_get(cfg, "vocab_size"), tied=cfg.get("tie_word_embeddings", True) is not False,
            qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False, norm="layer",
            learned_positions=_get(cfg, "n_positions", "max_position_embeddings"), name=name,
        )
    h = _get(cfg, "hidden_size")
    heads = _get(cfg, "num_attention_heads")
    layers = _get(cfg, "num_hidden_layers")
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    if h <= 0 or heads <= 0 or layers <= 0 or kv <= 0 or heads % kv:
        raise ModelConfigError(
            f"inconsistent attention sizes: hidden_size={h}, num_attention_heads={heads}, "
            f"num_key_value_heads={kv} (heads must be a positive multiple of kv heads)"
        )
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    moe_layers: tuple[int, ...] = ()
    moe_ffn = shared_ffn = top_k = 0
    if experts:
        top_k = int(_get(cfg, "num_experts_per_tok"))
        moe_ffn = int(cfg.get("moe_intermediate_size") or _get(cfg, "intermediate_size"))
        shared_ffn = int(cfg.get("shared_expert_intermediate_size") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelShape(
        hidden=h, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
        ffn=int(_get(cfg, "intermediate_size")), vocab=_get(cfg, "vocab_size"),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or model_type in ("qwen2", "qwen2_moe"),
        o_bias=attention_bias and model_type not in ("qwen2", "qwen2_moe"),
        mlp_bias=bool(cfg.get("mlp_bias", False)), gated_mlp=True, norm="rms",
        qk_norm=model_type in ("qwen3", "qwen3_moe"), experts=experts, top_k=top_k,
        moe_ffn=moe_ffn, shared_ffn=shared_ffn, shared_gate=bool(shared_ffn),
        moe_layers=moe_layers, name=name,
    )


def load_model_shape(spec: str) -> ModelShape:
    """A preset name, a ``config.json`` path, a folder holding one, or a hub id."""
    from toolkit.presets import PRESETS, get_preset

    if spec.lower() in PRESETS:
        return model_shape_from_hf(get_preset(spec), name=spec.lower())
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
        return model_shape_from_hf(cfg, name=path.parent.name or str(path))
    if path.exists() or spec.count("/") != 1:
        raise ModelConfigError(
            f"model {spec!r}: not a preset ({', '.join(sorted(PRESETS))}), not a config.json or "
            "a folder holding one, and not a hub id of the form owner/name"
        )
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(spec).to_dict()
    except OSError as e:
        raise ModelConfigError(f"could not fetch the config of hub model {spec!r}: {e}") from e
    return model_shape_from_hf(cfg, name=spec)
