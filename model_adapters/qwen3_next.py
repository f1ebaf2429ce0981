"""Qwen3-Next (``Qwen3NextForCausalLM``): gated DeltaNet layers (``layer_types``:
``linear_attention``; mdtk's ``toolkit.models.delta_net``: torch on CPU, fla / causal-conv1d on
GPUs) interleaved with gated full attention (megatron-core's ``attention_output_gate``: HF's
``q_proj`` holds a query and a gate per head; q/k norms, partial RoPE 0.25 by default), Qwen-MoE
experts with a gated shared expert, (1 + w) RMSNorms. Packed rows reset the DeltaNet state at
every example; context parallelism is refused. See docs/adding-a-model.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit.adapters import Dims, Family, HFConfig, Moe, UnsupportedModel, register
from toolkit.adapters.hfconfig import rope_kwargs, rope_parameters
from toolkit.adapters.hybrid import DeltaDims, linear_attention_layers
from toolkit.mapping import builders, fused_builders


@register
class Qwen3Next(Family):
    architectures = ("Qwen3NextForCausalLM",)
    model_types = ("qwen3_next",)
    defaults = {**Family.defaults, "norm_topk_prob": True, "head_dim": 256,
                "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                "linear_num_value_heads": 32, "full_attention_interval": 4}
    qk_norm = True
    qkv_bias = linear_bias = mlp_bias = False  # attention_bias=True is refused in check
    moe = Moe(shared=True, dense_layers=True, peft_fused=model_types)
    refuses_cp = "the gated DeltaNet (linear attention) has no context-parallel form"

    def dims(self, hf: Any) -> Dims:
        v, d = self.value, super().dims(hf)
        delta = DeltaDims(v(hf, "linear_num_key_heads"), v(hf, "linear_num_value_heads"),
                          v(hf, "linear_key_head_dim"), v(hf, "linear_value_head_dim"),
                          v(hf, "linear_conv_kernel_dim"))
        return dataclasses.replace(d, attn_gate=True, delta=delta,
                                   delta_layers=linear_attention_layers(hf, d.layers))

    def check(self, hf: Any) -> None:
        if getattr(hf, "attention_bias", None):
            raise UnsupportedModel("attention_bias=True: Qwen3-Next's MLP has no bias, and "
                                   "megatron-core has one bias switch for o_proj and the MLP.")
        d = self.dims(hf)
        if d.delta.v_heads % d.delta.k_heads:
            raise UnsupportedModel(f"linear_num_value_heads={d.delta.v_heads} is not a multiple "
                                   f"of linear_num_key_heads={d.delta.k_heads}.")
        super().check(hf)

    def rope(self, hf: Any) -> HFConfig:
        p = rope_parameters(hf)
        p.setdefault("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 0.25)
        return HFConfig({"rope_parameters": p})

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        d = self.dims(hf)
        return {**super().transformer_kwargs(hf), "attention_output_gate": True,
                "experimental_attention_variant": "gated_delta_net",
                "linear_attention_freq": [int(i in d.delta_layers) for i in range(d.layers)],
                "linear_conv_kernel_dim": d.delta.kernel, "linear_key_head_dim": d.delta.k_dim,
                "linear_value_head_dim": d.delta.v_dim, "linear_num_key_heads": d.delta.k_heads,
                "linear_num_value_heads": d.delta.v_heads}

    def spec_kwargs(self, hf: Any) -> dict[str, Any]:
        return {**super().spec_kwargs(hf), "zero_centered_norm": True}

    def model_kwargs(self, hf: Any) -> dict[str, Any]:
        return {"max_sequence_length": self.value(hf, "max_position_embeddings"),
                **rope_kwargs(self.rope(hf))}

    def layer_rules(self, d: Dims, i: int) -> builders.Rules:
        p = self.layer.format(i=i)
        mixer = (fused_builders.gated_delta_net(p + "linear_attn.", d) if i in d.delta_layers
                 else fused_builders.gated_attention(p + "self_attn.", d))
        return {**builders.norm("input_layernorm", p + self.input_norm, d), **mixer,
                **builders.norm("pre_mlp_layernorm", p + self.post_norm, d),
                **self.mlp_rules(d, i, p)}
