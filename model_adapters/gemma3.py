"""Gemma 3 text (``Gemma3ForCausalLM``): Llama's layout plus Gemma's pieces of the layer spec.

(1 + w) RMSNorms (``w`` stored as is, so checkpoints round-trip bit-exactly), the embedding
scaled by sqrt(hidden), GeGLU, q/k norms, norms after the attention and MLP outputs
(``pre_feedforward_layernorm`` is the pre-MLP norm), softmax scale ``query_pre_attn_scalar **
-0.5``, sliding / global layers (``layer_types`` or older ``sliding_window_pattern``) with RoPE
bases ``rope_local_base_freq`` / ``rope_theta`` (+ scaling), tied. Logit soft-capping (null in
Gemma 3) and bidirectional attention are refused. See ``toolkit/models/gemma.py``.
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
    qkv_bias = linear_bias = mlp_bias = False  # attention_bias=True is refused in check
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
        cap = "megatron-core has no tanh soft-capping of logits (null in Gemma 3 checkpoints)"
        why = {"attn_logit_softcapping": cap, "final_logit_softcapping": cap,
               "use_bidirectional_attention": "mdtk builds causal decoders only",
               "attention_bias": "Gemma's MLP has no bias, and megatron-core has one bias "
               "switch for o_proj and the MLP"}
        for key, reason in why.items():
            if getattr(hf, key, None) not in (None, False):
                raise UnsupportedModel(f"{key}={getattr(hf, key)}: {reason}.")
        if (kind := self.rope(hf, "sliding_attention").get("rope_type", "default")) != "default":
            raise UnsupportedModel(f"sliding-attention rope_type={kind!r}: only default RoPE "
                                   "is supported on sliding-window layers.")
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
