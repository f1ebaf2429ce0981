"""Phi-3 / Phi-3.5-mini / Phi-4 / Phi-4-mini (``Phi3ForCausalLM``): Llama with fused projections.

``qkv_proj`` stores q, k and v one after another along its output dimension and ``gate_up_proj``
the gate then the up projection; the rules read them as parts of the one stored tensor (no copy).
``partial_rotary_factor`` (Phi-4-mini: 0.75) is megatron-core's ``rotary_percent``: both rotate
the first ``head_dim * factor`` channels, rotate-half, and pass the rest through.
``sliding_window`` (Phi-3-mini: 2047) is megatron-core's ``window_size``. LongRoPE (the 128k
Phi-3 / Phi-3.5 / Phi-4-mini checkpoints: per-channel short/long factors) is refused:
megatron-core's RotaryEmbedding cannot compute it. ``embd_pdrop`` is ignored, as transformers does;
``resid_pdrop`` is the residual dropout (``hidden_dropout``).
"""

from __future__ import annotations

from typing import Any

from toolkit.adapters import Dims, Family, UnsupportedModel, register
from toolkit.adapters.hfconfig import rope_parameters
from toolkit.mapping import builders


@register
class Phi3(Family):
    architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)
    keys = {"hidden_dropout": "resid_pdrop"}
    defaults = {**Family.defaults, "rms_norm_eps": 1e-5, "resid_pdrop": 0.0}
    qkv_bias = linear_bias = mlp_bias = False  # Phi-3 has no bias switch and no biases

    def check(self, hf: Any) -> None:
        kind = rope_parameters(hf).get("rope_type", "default")
        if kind in ("longrope", "su", "yarn"):  # transformers reads Phi-3's "su"/"yarn" as longrope
            raise UnsupportedModel(
                f"rope_type={kind!r} (LongRoPE, the 128k-context Phi-3 / Phi-3.5 / Phi-4-mini "
                "checkpoints): megatron-core's RotaryEmbedding has no per-channel short/long "
                "factors. Use a checkpoint with default RoPE (Phi-3-mini-4k, Phi-4).")
        super().check(hf)

    def attention_rules(self, d: Dims, p: str) -> builders.Rules:
        return builders.fused_attention(p + "self_attn.qkv_proj", p + "self_attn.o_proj", d)

    def mlp_rules(self, d: Dims, i: int, p: str) -> builders.Rules:
        return builders.fused_gated_mlp(p + "mlp.gate_up_proj", p + "mlp.down_proj", d.hidden,
                                        d.ffn)
