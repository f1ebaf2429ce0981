"""Gemma 3 text (``Gemma3ForCausalLM``): Llama's layout plus Gemma's pieces, from the layer spec.

(1 + w) RMSNorms everywhere (weights stored as is: ``toolkit.models.gemma.ZeroCenteredRMSNorm``
computes 1 + w, so checkpoints round-trip bit-exactly), the embedding scaled by sqrt(hidden),
GeGLU (``gelu_pytorch_tanh``), q/k norms, ``post_attention_layernorm`` / ``post_feedforward_
layernorm`` after the attention and MLP outputs (``pre_feedforward_layernorm`` is the pre-MLP
norm), softmax scale ``query_pre_attn_scalar ** -0.5``, sliding-window layers (``layer_types``,
or ``sliding_window_pattern`` in older configs) with RoPE base ``rope_local_base_freq`` and
global layers with ``rope_theta`` (and its scaling), tied embeddings. Soft-capping of attention
logits or final logits (Gemma 2's, null in Gemma 3) and bidirectional attention are refused.
"""

from __future__ import annotations

from typing import Any

from toolkit.adapters import Dims, Family, HFConfig, UnsupportedModel, register
from toolkit.adapters.hfconfig import rope_kwargs, rope_parameters
from toolkit.mapping import builders


@register
class Gemma3(Family):
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    keys = {"hidden_act": "hidden_activation"}
    defaults = {**Family.defaults, "vocab_size": 262208, "hidden_size": 2304,  # config class
                "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                "max_position_embeddings": 131072, "tie_word_embeddings": True,
                "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0}
    qkv_bias = linear_bias = "attention_bias"
    mlp_bias = False  # Gemma's MLP has no bias: attention_bias=True is refused (one switch)
    qk_norm = post_norms = True
    gated_activations = ("gelu_pytorch_tanh",)
    post_norm = "pre_feedforward_layernorm."

    def rope(self, hf: Any, kind: str) -> dict[str, Any]:
        """RoPE parameters of ``full_attention`` or ``sliding_attention`` layers."""
        p = rope_parameters(hf)
        if kind in p:  # transformers 5: one entry per layer type
            return dict(p[kind])
        if kind == "sliding_attention":  # older config.json: rope_local_base_freq, no scaling
            return {"rope_type": "default",
                    "rope_theta": self.value(hf, "rope_local_base_freq")}
        return {**p, "rope_theta": getattr(hf, "rope_theta", None) or 1e6}

    def check(self, hf: Any) -> None:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(hf, key, None) is not None:
                raise UnsupportedModel(
                    f"{key}={getattr(hf, key)}: megatron-core has no tanh soft-capping of "
                    "logits. Gemma 3 checkpoints set it to null; set it to null only if the "
                    "model was trained without it.")
        if getattr(hf, "use_bidirectional_attention", False):
            raise UnsupportedModel("use_bidirectional_attention=True (embedding models): "
                                   "mdtk builds causal decoders only.")
        local = self.rope(hf, "sliding_attention")
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModel(f"sliding-attention rope_type={local['rope_type']!r}: only "
                                   "default RoPE is supported on sliding-window layers.")
        super().check(hf)

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        scale = float(self.value(hf, "query_pre_attn_scalar")) ** -0.5
        return {**super().transformer_kwargs(hf), "softmax_scale": scale}

    def spec_kwargs(self, hf: Any) -> dict[str, Any]:
        local = float(self.rope(hf, "sliding_attention")["rope_theta"])
        return {**super().spec_kwargs(hf), "zero_centered_norm": True, "post_norms": True,
                "local_rotary_base": local}

    def model_kwargs(self, hf: Any) -> dict[str, Any]:
        rope = rope_kwargs(HFConfig({"rope_parameters": self.rope(hf, "full_attention")}))
        return {"max_sequence_length": self.value(hf, "max_position_embeddings"), **rope,
                "embedding_scale": float(self.value(hf, "hidden_size")) ** 0.5}

    def layer_rules(self, d: Dims, i: int) -> builders.Rules:
        p = self.layer.format(i=i)
        return {**super().layer_rules(d, i),
                **builders.norm("self_attention.linear_proj.post_layernorm",
                                p + "post_attention_layernorm.", d),
                **builders.norm("mlp.linear_fc2.post_layernorm",
                                p + "post_feedforward_layernorm.", d)}
