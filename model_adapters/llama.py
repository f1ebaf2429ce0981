"""Llama 2 / 3 / 3.1 / 3.2 (``LlamaForCausalLM``), and the base of the Llama-like families.

Pre-norm RMSNorm decoder, GQA attention with rotate-half RoPE (megatron-core's default,
non-interleaved), SwiGLU MLP. Mistral, Qwen2 and Qwen3 differ only in the switches below.
"""

from __future__ import annotations

from typing import Any

from model_adapters import register
from toolkit.adapters import Dims, Family, UnsupportedModel, activation
from toolkit.mapping import QKV, GateUp, Part, Replicated, Row, Rule, Table, vocab

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
    ``(left, 0)`` allows ``q - k <= left``, hence ``left = sliding_window - 1``.
    """
    size = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
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


@register
class Llama(Family):
    architectures = ("LlamaForCausalLM",)

    # Switches of the Llama-like families.
    qkv_bias_always = False  # Qwen2: q/k/v biases, no other bias
    qk_norm = False  # Qwen3: RMSNorm over head_dim on q and k

    def biases(self, hf: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj + MLP bias)."""
        if self.qkv_bias_always:
            return True, False
        attn, mlp = bool(getattr(hf, "attention_bias", False)), bool(getattr(hf, "mlp_bias", False))
        if attn != mlp:
            raise UnsupportedModel(
                f"attention_bias={attn} with mlp_bias={mlp}: megatron-core has one switch "
                "(add_bias_linear) for the o_proj and MLP biases; both must be equal."
            )
        return attn, attn

    def check(self, hf: Any) -> None:
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModel(f"hidden_act={act!r}: the Llama-like mapping is SwiGLU only.")
        rope_kwargs(hf)
        self.biases(hf)

    def dims(self, hf: Any) -> Dims:
        heads = hf.num_attention_heads
        return Dims(
            hidden=hf.hidden_size, layers=hf.num_hidden_layers, heads=heads,
            groups=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            ffn=hf.intermediate_size, vocab=hf.vocab_size,
            tied=bool(getattr(hf, "tie_word_embeddings", False)),
        )

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        d = self.dims(hf)
        qkv_bias, linear_bias = self.biases(hf)
        return dict(
            num_layers=d.layers, hidden_size=d.hidden, num_attention_heads=d.heads,
            num_query_groups=d.groups, kv_channels=d.head_dim, ffn_hidden_size=d.ffn,
            normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True, activation_func=activation(hf.hidden_act),
            add_bias_linear=linear_bias, add_qkv_bias=qkv_bias, qk_layernorm=self.qk_norm,
            hidden_dropout=0.0, attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),
            init_method_std=hf.initializer_range, **window_kwargs(hf),
        )

    def spec_kwargs(self, hf: Any) -> dict[str, Any]:
        return {"normalization": "RMSNorm", "qk_layernorm": self.qk_norm}

    def model_kwargs(self, hf: Any) -> dict[str, Any]:
        return {"max_sequence_length": hf.max_position_embeddings, **rope_kwargs(hf)}

    def attention_rules(self, hf: Any, d: Dims, p: str) -> dict[str, Rule]:
        qkv_bias, linear_bias = self.biases(hf)
        a = f"{p}self_attn."
        rules: dict[str, Rule] = {
            "self_attention.linear_qkv.weight": QKV(
                Part(a + "q_proj.weight"), Part(a + "k_proj.weight"), Part(a + "v_proj.weight"),
                d.heads, d.groups, d.head_dim, inn=d.hidden),
            "self_attention.linear_proj.weight": Row(a + "o_proj.weight", d.hidden,
                                                     d.heads * d.head_dim),
        }
        if qkv_bias:
            rules["self_attention.linear_qkv.bias"] = QKV(
                Part(a + "q_proj.bias"), Part(a + "k_proj.bias"), Part(a + "v_proj.bias"),
                d.heads, d.groups, d.head_dim)
        if linear_bias:
            rules["self_attention.linear_proj.bias"] = Replicated(a + "o_proj.bias", (d.hidden,))
        if self.qk_norm:
            rules["self_attention.q_layernorm.weight"] = Replicated(a + "q_norm.weight",
                                                                    (d.head_dim,))
            rules["self_attention.k_layernorm.weight"] = Replicated(a + "k_norm.weight",
                                                                    (d.head_dim,))
        return rules

    def mlp_rules(self, hf: Any, d: Dims, p: str) -> dict[str, Rule]:
        _, bias = self.biases(hf)
        m = f"{p}mlp."
        rules: dict[str, Rule] = {
            "mlp.linear_fc1.weight": GateUp(Part(m + "gate_proj.weight"),
                                            Part(m + "up_proj.weight"), d.ffn, inn=d.hidden),
            "mlp.linear_fc2.weight": Row(m + "down_proj.weight", d.hidden, d.ffn),
        }
        if bias:
            rules["mlp.linear_fc1.bias"] = GateUp(Part(m + "gate_proj.bias"),
                                                  Part(m + "up_proj.bias"), d.ffn)
            rules["mlp.linear_fc2.bias"] = Replicated(m + "down_proj.bias", (d.hidden,))
        return rules

    def expert_rules(self, hf: Any, d: Dims, i: int) -> list[dict[str, Rule]]:
        """Rules of each expert of layer i (suffixes after ``mlp.experts.local_experts.<e>.``);
        none for dense families."""
        return []

    def layer_rules(self, hf: Any, d: Dims, i: int) -> dict[str, Rule]:
        p = f"model.layers.{i}."
        return {
            "input_layernorm.weight": Replicated(p + "input_layernorm.weight", (d.hidden,)),
            **self.attention_rules(hf, d, p),
            "pre_mlp_layernorm.weight": Replicated(p + "post_attention_layernorm.weight",
                                                   (d.hidden,)),
            **self.mlp_rules(hf, d, p),
        }

    def table(self, hf: Any, d: Dims, padded_vocab: int) -> Table:
        embed = "model.embed_tokens.weight"
        head = embed if d.tied else "lm_head.weight"
        return Table(
            embedding={"embedding.word_embeddings.weight": vocab(embed, d.vocab, padded_vocab,
                                                                 d.hidden)},
            layers=[self.layer_rules(hf, d, i) for i in range(d.layers)],
            experts=[self.expert_rules(hf, d, i) for i in range(d.layers)],
            head={"decoder.final_layernorm.weight": Replicated("model.norm.weight", (d.hidden,)),
                  "output_layer.weight": vocab(head, d.vocab, padded_vocab, d.hidden)},
            tied=d.tied,
        )
