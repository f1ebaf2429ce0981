"""GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm, biases everywhere, tied embeddings.

HF's ``Conv1D`` stores weights as ``[in, out]`` (``transpose=True`` in the rules) and ``c_attn``
holds q, k and v side by side along its output dimension (three ``Part``s of one tensor).
``gelu_new`` is the tanh GELU (megatron-core's ``openai_gelu`` formula).
"""

from __future__ import annotations

from typing import Any

from model_adapters import register
from toolkit.adapters import Dims, Family, UnsupportedModel, activation
from toolkit.mapping import QKV, Column, Part, Replicated, Row, Rule, Table, vocab


@register
class GPT2(Family):
    architectures = ("GPT2LMHeadModel",)
    base_prefix = "transformer."
    # Old checkpoints store the causal-mask buffers of each attention block; they are not
    # weights (HF drops them on load as well).
    ignored = (r"(^|\.)h\.\d+\.attn\.(masked_)?bias$",)

    def check(self, hf: Any) -> None:
        activation(hf.activation_function)
        if hf.scale_attn_by_inverse_layer_idx:
            raise UnsupportedModel("scale_attn_by_inverse_layer_idx=True has no megatron-core "
                                   "equivalent (its query-key layer scaling cancels out).")
        if getattr(hf, "add_cross_attention", False):
            raise UnsupportedModel("add_cross_attention=True: decoder-only models only.")

    def dims(self, hf: Any) -> Dims:
        return Dims(hidden=hf.n_embd, layers=hf.n_layer, heads=hf.n_head, groups=hf.n_head,
                    head_dim=hf.n_embd // hf.n_head, ffn=hf.n_inner or 4 * hf.n_embd,
                    vocab=hf.vocab_size, tied=bool(getattr(hf, "tie_word_embeddings", True)))

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        d = self.dims(hf)
        extra = {} if hf.scale_attn_weights else {"softmax_scale": 1.0}
        return dict(
            num_layers=d.layers, hidden_size=d.hidden, num_attention_heads=d.heads,
            num_query_groups=d.groups, kv_channels=d.head_dim, ffn_hidden_size=d.ffn,
            normalization="LayerNorm", layernorm_epsilon=hf.layer_norm_epsilon,
            gated_linear_unit=False, activation_func=activation(hf.activation_function),
            add_bias_linear=True, hidden_dropout=hf.resid_pdrop, attention_dropout=hf.attn_pdrop,
            init_method_std=hf.initializer_range, **extra,
        )

    def spec_kwargs(self, hf: Any) -> dict[str, Any]:
        return {"normalization": "LayerNorm"}

    def model_kwargs(self, hf: Any) -> dict[str, Any]:
        return {"max_sequence_length": hf.n_positions,
                "position_embedding_type": "learned_absolute"}

    def layer_rules(self, d: Dims, i: int) -> dict[str, Rule]:
        p, h, f = f"transformer.h.{i}.", d.hidden, d.ffn
        attn = p + "attn.c_attn."
        qkv_w = [Part(attn + "weight", k * h) for k in range(3)]
        qkv_b = [Part(attn + "bias", k * h) for k in range(3)]
        return {
            "input_layernorm.weight": Replicated(p + "ln_1.weight", (h,)),
            "input_layernorm.bias": Replicated(p + "ln_1.bias", (h,)),
            "self_attention.linear_qkv.weight": QKV(*qkv_w, d.heads, d.groups, d.head_dim,
                                                    inn=h, transpose=True),
            "self_attention.linear_qkv.bias": QKV(*qkv_b, d.heads, d.groups, d.head_dim),
            "self_attention.linear_proj.weight": Row(p + "attn.c_proj.weight", h, h,
                                                     transpose=True),
            "self_attention.linear_proj.bias": Replicated(p + "attn.c_proj.bias", (h,)),
            "pre_mlp_layernorm.weight": Replicated(p + "ln_2.weight", (h,)),
            "pre_mlp_layernorm.bias": Replicated(p + "ln_2.bias", (h,)),
            "mlp.linear_fc1.weight": Column(p + "mlp.c_fc.weight", f, h, transpose=True),
            "mlp.linear_fc1.bias": Column(p + "mlp.c_fc.bias", f),
            "mlp.linear_fc2.weight": Row(p + "mlp.c_proj.weight", h, f, transpose=True),
            "mlp.linear_fc2.bias": Replicated(p + "mlp.c_proj.bias", (h,)),
        }

    def table(self, hf: Any, d: Dims, padded_vocab: int) -> Table:
        wte = "transformer.wte.weight"
        head = wte if d.tied else "lm_head.weight"
        return Table(
            embedding={
                "embedding.word_embeddings.weight": vocab(wte, d.vocab, padded_vocab, d.hidden),
                "embedding.position_embeddings.weight": Replicated(
                    "transformer.wpe.weight", (hf.n_positions, d.hidden)),
            },
            layers=[self.layer_rules(d, i) for i in range(d.layers)],
            head={
                "decoder.final_layernorm.weight": Replicated("transformer.ln_f.weight",
                                                             (d.hidden,)),
                "decoder.final_layernorm.bias": Replicated("transformer.ln_f.bias", (d.hidden,)),
                "output_layer.weight": vocab(head, d.vocab, padded_vocab, d.hidden),
            },
            tied=d.tied,
        )
