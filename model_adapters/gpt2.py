"""GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm, biases everywhere, tied embeddings.

HF's ``Conv1D`` stores weights as ``[in, out]`` (``transpose=True`` in the rules) and ``c_attn``
holds q, k and v side by side along its output dimension (``builders.fused_attention``).
``gelu_new`` is the tanh GELU (megatron-core's ``openai_gelu`` formula).
"""

from __future__ import annotations

from typing import Any

from toolkit.adapters import Dims, Family, UnsupportedModel, register
from toolkit.mapping import builders


@register
class GPT2(Family):
    architectures = ("GPT2LMHeadModel",)
    model_types = ("gpt2",)
    base_prefix = "transformer."
    # Old checkpoints store the causal-mask buffers of each attention block; they are not
    # weights (HF drops them on load as well).
    ignored = (r"(^|\.)h\.\d+\.attn\.(masked_)?bias$",)
    keys = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads":
            "n_head", "intermediate_size": "n_inner", "max_position_embeddings": "n_positions",
            "hidden_act": "activation_function", "rms_norm_eps": "layer_norm_epsilon",
            "hidden_dropout": "resid_pdrop", "attention_dropout": "attn_pdrop"}
    defaults = {"tie_word_embeddings": True, "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "resid_pdrop": 0.1,
                "attn_pdrop": 0.1}
    norm, gated, ffn_factor, learned_positions = "LayerNorm", False, 4, True
    qkv_bias = linear_bias = mlp_bias = True
    embed, position_table = "transformer.wte.weight", "transformer.wpe.weight"
    layer, input_norm, post_norm = "transformer.h.{i}.", "ln_1.", "ln_2."
    final_norm = "transformer.ln_f."

    def check(self, hf: Any) -> None:
        super().check(hf)
        if getattr(hf, "scale_attn_by_inverse_layer_idx", False):
            raise UnsupportedModel("scale_attn_by_inverse_layer_idx=True has no megatron-core "
                                   "equivalent (its query-key layer scaling cancels out).")
        if getattr(hf, "add_cross_attention", False):
            raise UnsupportedModel("add_cross_attention=True: decoder-only models only.")

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        unscaled = not getattr(hf, "scale_attn_weights", True)
        return {**super().transformer_kwargs(hf), **({"softmax_scale": 1.0} if unscaled else {})}

    def attention_rules(self, d: Dims, p: str) -> builders.Rules:
        return builders.fused_attention(p + "attn.c_attn", p + "attn.c_proj", d, transpose=True)

    def mlp_rules(self, d: Dims, i: int, p: str) -> builders.Rules:
        return builders.mlp(p + "mlp.c_fc", p + "mlp.c_proj", d.hidden, d.ffn, bias=d.linear_bias,
                            transpose=True)
