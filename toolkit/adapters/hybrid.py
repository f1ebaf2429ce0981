"""Per-layer kinds of hybrid HF configs (torch-free): Qwen3-Next's linear / full attention
layers, Llama 4's RoPE (chunked) / NoPE layers and its MoE layers.

Each reader takes the config's list as transformers writes it into config.json
(``layer_types``, ``no_rope_layers``, ``moe_layers``), or the older interval keys when the list
is absent, and refuses a list mdtk cannot build with one ``UnsupportedModel`` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolkit.adapters.hfconfig import UnsupportedModel


@dataclass(frozen=True)
class DeltaDims:
    """Sizes of the gated DeltaNet (linear attention) layers of a hybrid model (Qwen3-Next)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int

    @property
    def conv_channels(self) -> int:
        """Channels of the causal convolution (q, k and v)."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def in_features(self) -> int:
        """Output rows of the fused input projection (q, k, v, the output gate z, beta, a)."""
        return self.conv_channels + self.v_heads * (self.v_dim + 2)


def _kinds(hf: Any, key: str, layers: int, allowed: tuple[str, ...]) -> list[str]:
    kinds = list(getattr(hf, key))
    if len(kinds) != layers:
        raise UnsupportedModel(f"{key} has {len(kinds)} entries for num_hidden_layers={layers}: "
                               "one per layer is needed.")
    if bad := sorted({k for k in kinds if k not in allowed}):
        raise UnsupportedModel(f"{key} holds {bad}: mdtk builds {' and '.join(allowed)} layers "
                               "of this family only.")
    return kinds


def linear_attention_layers(hf: Any, layers: int) -> tuple[int, ...]:
    """Qwen3-Next's gated DeltaNet layers: ``layer_types`` (``linear_attention`` /
    ``full_attention``), else every layer but each ``full_attention_interval``-th."""
    if getattr(hf, "layer_types", None) is None:
        every = getattr(hf, "full_attention_interval", None) or 4
        return tuple(i for i in range(layers) if (i + 1) % every)
    kinds = _kinds(hf, "layer_types", layers, ("linear_attention", "full_attention"))
    return tuple(i for i, k in enumerate(kinds) if k == "linear_attention")


@dataclass(frozen=True)
class Llama4Layers:
    """Llama 4's layer kinds: RoPE layers (the others are NoPE), chunked-attention layers and
    MoE layers (the others have the dense MLP)."""

    rope: tuple[int, ...]
    chunked: tuple[int, ...]
    moe: tuple[int, ...]


def llama4_layers(hf: Any, layers: int) -> Llama4Layers:
    """transformers' rules: ``no_rope_layers`` (1 = RoPE; default every
    ``no_rope_layer_interval``-th layer NoPE), ``layer_types`` (default: RoPE layers chunked),
    ``moe_layers`` (default every ``interleave_moe_layer_step``-th layer)."""
    flags = getattr(hf, "no_rope_layers", None)
    if not flags:
        every = getattr(hf, "no_rope_layer_interval", None) or 4
        flags = [int((i + 1) % every != 0) for i in range(layers)]
    if len(flags) < layers or any(f not in (0, 1) for f in flags):
        raise UnsupportedModel(f"no_rope_layers={list(flags)}: one 0 (NoPE) or 1 (RoPE) per layer "
                               f"is needed for num_hidden_layers={layers}.")
    rope = tuple(i for i in range(layers) if flags[i])
    if getattr(hf, "layer_types", None) is None:
        chunked = rope
    else:
        kinds = _kinds(hf, "layer_types", layers, ("chunked_attention", "full_attention"))
        chunked = tuple(i for i, k in enumerate(kinds) if k == "chunked_attention")
    moe = getattr(hf, "moe_layers", None)
    if moe is None:
        step = getattr(hf, "interleave_moe_layer_step", None) or 1
        moe = range(step - 1, layers, step)
    if any(not 0 <= i < layers for i in moe):
        raise UnsupportedModel(f"moe_layers={list(moe)}: layer numbers must be below "
                               f"num_hidden_layers={layers}.")
    return Llama4Layers(rope=rope, chunked=chunked, moe=tuple(sorted(set(moe))))
