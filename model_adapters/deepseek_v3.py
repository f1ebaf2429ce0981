"""DeepSeek-V3 / R1 (``DeepseekV3ForCausalLM``): multi-latent attention + DeepSeekMoE.

MLA: megatron-core's ``MLASelfAttention`` (``builders.mla_attention``; its RoPE de-interleaves
pairs as HF's ``rope_interleave``; YaRN: ``hfconfig.mla_rope_kwargs``). Routing: sigmoid +
``e_score_correction_bias`` (the router's ``expert_bias`` buffer), group-limited top-k (group
score: top ``top_k // topk_group`` sum; HF's: top-2), renormalised, x ``routed_scaling_factor``;
an ungated shared expert; the first ``first_k_dense_replace`` layers dense; no aux loss (HF has
none). Details and the MTP layers: docs/models/deepseek_v3.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit.adapters import Dims, Family, Moe, UnsupportedModel, register
from toolkit.adapters.hfconfig import mla_rope_kwargs, sigmoid_routing
from toolkit.mapping import builders


@register
class DeepseekV3(Family):
    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3", "kimi_k2")
    transformers_types = {"kimi_k2": "deepseek_v3"}  # Kimi K2: DeepSeek-V3 at other sizes
    defaults = {**Family.defaults, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "rope_interleave": True}
    moe = Moe(experts_key=("n_routed_experts", "num_local_experts"), dense_layers=True,
              peft_fused=("deepseek_v3",))
    qkv_bias = linear_bias = mlp_bias = False
    extra_layers = True  # the MTP layers stored past num_hidden_layers: kept aside

    def dims(self, hf: Any) -> Dims:
        v, d = self.value, super().dims(hf)
        return dataclasses.replace(
            d, groups=d.heads, head_dim=v(hf, "v_head_dim"), kv_lora=v(hf, "kv_lora_rank"),
            q_lora=v(hf, "q_lora_rank", None) or 0, qk_nope=v(hf, "qk_nope_head_dim"),
            qk_rope=v(hf, "qk_rope_head_dim"), shared_ffn=v(hf, "n_shared_experts") * d.ffn,
            router_bias=True)

    def check(self, hf: Any) -> None:
        v = self.value
        ok = {"rope_interleave": v(hf, "rope_interleave"),
              "attention_bias": not v(hf, "attention_bias"),
              "rms_norm_eps": v(hf, "rms_norm_eps") == 1e-6}  # HF's latent norms use 1e-6
        if bad := {k: getattr(hf, k, None) for k, good in ok.items() if not good}:
            raise UnsupportedModel(f"DeepSeek-V3 config {bad}: megatron-core's MLA cannot "
                                   "compute this as HF does (docs/models/deepseek_v3.md).")
        sigmoid_routing(hf, v, self.dims(hf).top_k)
        mla_rope_kwargs(hf)
        super().check(hf)

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        d = self.dims(hf)
        return {**super().transformer_kwargs(hf), **mla_rope_kwargs(hf),
                **sigmoid_routing(hf, self.value, d.top_k),
                "multi_latent_attention": True, "kv_channels": d.head_dim,
                "v_head_dim": d.head_dim, "q_lora_rank": d.q_lora or None,
                "kv_lora_rank": d.kv_lora, "qk_head_dim": d.qk_nope,
                "qk_pos_emb_head_dim": d.qk_rope}

    def model_kwargs(self, hf: Any) -> dict[str, Any]:  # MLA builds its own RoPE (not GPTModel)
        return {"max_sequence_length": self.value(hf, "max_position_embeddings"),
                "position_embedding_type": "rope"}

    def attention_rules(self, d: Dims, p: str) -> builders.Rules:
        return builders.mla_attention(p + "self_attn.", d.hidden, d.heads, d.q_lora, d.kv_lora,
                                      d.qk_nope, d.qk_rope, d.head_dim)

    def mlp_rules(self, d: Dims, i: int, p: str) -> builders.Rules:
        if i in d.dense_layers:
            return super().mlp_rules(d, i, p)
        return {**builders.scored_router(p + "mlp.gate.", d),
                **builders.shared_experts(p + "mlp.shared_experts.", None, d.hidden, d.shared_ffn)}
