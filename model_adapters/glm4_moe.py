"""GLM-4.5 / GLM-4.5-Air (``Glm4MoeForCausalLM``): GQA attention with q/k/v biases (no o_proj
bias), partial RoPE (``partial_rotary_factor``, megatron-core's ``rotary_percent``), optional
q/k norm (``use_qk_norm``), and DeepSeek-V3's MoE: sigmoid routing with the score-correction
bias, group-limited top-k, renormalised, x ``routed_scaling_factor``
(``hfconfig.sigmoid_routing``), an ungated shared expert of ``n_shared_experts *
moe_intermediate_size``, the first ``first_k_dense_replace`` layers dense. The multi-token-
prediction layers stored past ``num_hidden_layers`` are kept aside (as DeepSeek-V3's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit.adapters import Dims, Family, Moe, register
from toolkit.adapters.hfconfig import sigmoid_routing
from toolkit.mapping import builders


@register
class Glm4Moe(Family):
    architectures = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)
    defaults = {**Family.defaults, "vocab_size": 151552, "hidden_size": 4096,  # config class
                "intermediate_size": 10944, "num_hidden_layers": 46, "num_attention_heads": 96,
                "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "moe_intermediate_size": 1408, "num_experts_per_tok": 8,
                "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0,
                "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                "norm_topk_prob": True, "use_qk_norm": False}
    moe = Moe(experts_key=("n_routed_experts", "num_local_experts"), dense_layers=True,
              peft_fused=model_types)
    qkv_bias = "attention_bias"
    linear_bias = mlp_bias = False  # o_proj and the MLPs have no bias
    extra_layers = True  # the MTP layers stored past num_hidden_layers: kept aside

    def dims(self, hf: Any) -> Dims:
        v, d = self.value, super().dims(hf)
        return dataclasses.replace(d, qk_norm=bool(v(hf, "use_qk_norm")), router_bias=True,
                                   shared_ffn=v(hf, "n_shared_experts") * d.ffn)

    def check(self, hf: Any) -> None:
        sigmoid_routing(hf, self.value, self.dims(hf).top_k)
        super().check(hf)

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        return {**super().transformer_kwargs(hf),
                **sigmoid_routing(hf, self.value, self.dims(hf).top_k)}

    def mlp_rules(self, d: Dims, i: int, p: str) -> builders.Rules:
        if i in d.dense_layers:
            return super().mlp_rules(d, i, p)
        return {**builders.scored_router(p + "mlp.gate.", d),
                **builders.shared_experts(p + "mlp.shared_experts.", None, d.hidden, d.shared_ffn)}
