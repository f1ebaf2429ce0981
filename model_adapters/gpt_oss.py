"""GPT-OSS (``GptOssForCausalLM``): attention sinks, sliding / full layers, YaRN, biased clamped-
SwiGLU experts stored fused (``mapping.stacked``), MXFP4 (``checkpoint.mxfp4``); see the docs."""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit.adapters import Dims, Family, HFConfig, Moe, UnsupportedModel, register
from toolkit.adapters.hfconfig import window_kwargs, yarn_kwargs
from toolkit.mapping import Column, Replicated, builders
from toolkit.mapping.stacked import Stack, fused_experts

ALPHA = 1.702  # quick GELU's gain: the only swiglu_alpha megatron-core computes


@register
class GptOss(Family):
    architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    defaults = {**Family.defaults, "vocab_size": 201088, "hidden_size": 2880,  # config class
                "intermediate_size": 2880, "num_hidden_layers": 36, "num_local_experts": 128,
                "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
                "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "num_experts_per_tok": 4, "swiglu_alpha": ALPHA, "swiglu_limit": 7.0,
                "attention_bias": True}
    moe = Moe(experts_key=("num_local_experts",), ffn_key="intermediate_size", renormalise=True)
    mlp_bias = True  # the experts always have biases; attention_bias must agree (one switch)
    gated_activations = ("quick_gelu",)
    refuses_cp = "mdtk's context-parallel attention has no attention sinks nor sliding windows"

    def layer_types(self, hf: Any) -> list[str]:  # transformers' default: sliding first
        return getattr(hf, "layer_types", None) or [("full_attention", "sliding_attention")[
            (i + 1) % 2] for i in range(self.value(hf, "num_hidden_layers"))]

    def check(self, hf: Any) -> None:
        types, layers = self.layer_types(hf), self.value(hf, "num_hidden_layers")
        kinds = {"sliding_attention", "full_attention"}
        if len(types) != layers or not set(types) <= kinds:
            raise UnsupportedModel(f"layer_types={types}: GPT-OSS layers are one of "
                                   f"{sorted(kinds)}, {layers} of them; fix it in config.json.")
        super().check(hf)

    def activation(self, hf: Any) -> str:
        alpha = self.value(hf, "swiglu_alpha")
        if alpha != ALPHA:
            raise UnsupportedModel(f"swiglu_alpha={alpha}: megatron-core's clamped GLU applies "
                                   f"quick GELU, whose gain is {ALPHA}.")
        return "quick_gelu"

    def dims(self, hf: Any) -> Dims:
        return dataclasses.replace(super().dims(hf), sinks=True, router_bias=True)

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        windows = HFConfig({"sliding_window": self.value(hf, "sliding_window"),
                            "layer_types": self.layer_types(hf)})
        return {**super().transformer_kwargs(hf), **window_kwargs(windows),
                **yarn_kwargs(hf)[1], "softmax_type": "learnable", "glu_linear_offset": 1.0,
                "activation_func_clamp_value": float(self.value(hf, "swiglu_limit"))}

    def model_kwargs(self, hf: Any) -> dict[str, Any]:
        return {"max_sequence_length": self.value(hf, "max_position_embeddings"),
                **yarn_kwargs(hf)[0]}

    def attention_rules(self, d: Dims, p: str) -> builders.Rules:
        return {**super().attention_rules(d, p),
                "self_attention.core_attention.softmax_offset": Column(p + "self_attn.sinks",
                                                                       d.heads)}

    def mlp_rules(self, d: Dims, i: int, p: str) -> builders.Rules:
        return {**builders.router(p + "mlp.router.weight", d),
                "mlp.router.bias": Replicated(p + "mlp.router.bias", (d.experts,))}

    def expert_rules(self, d: Dims, i: int) -> list[builders.Rules]:
        return builders.experts(f"{self.layer.format(i=i)}mlp.experts.", d.experts, d.hidden,
                                d.ffn, bias=True)

    def stacks(self, hf: Any, d: Dims) -> list[Stack]:
        return [s for i in range(d.layers) for s in fused_experts(
            f"{self.layer.format(i=i)}mlp.experts.", d.experts, d.hidden, d.ffn)]
