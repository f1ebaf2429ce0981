"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (q/k norm over ``head_dim``, no q/k/v
bias) + routed experts, no shared expert.

Same on-disk expert and router names as Qwen2-MoE (``mlp.experts.E.gate_proj/up_proj/down_proj``,
``mlp.gate.weight``), same routing translation (``norm_topk_prob``, True in the released
checkpoints: top-k then softmax). ``head_dim`` may differ from hidden_size / num_attention_heads
(megatron-core's ``kv_channels``). ``attention_bias=True`` is refused (it adds an o_proj bias
but no MLP bias; megatron-core has one switch for both). Dense layers (``mlp_only_layers``,
``decoder_sparse_step`` != 1) map as in Qwen2-MoE (``moe_layer_freq``).
"""

from __future__ import annotations

from toolkit.adapters import Family, Moe, register


@register
class Qwen3Moe(Family):
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    defaults = {**Family.defaults, "norm_topk_prob": False}
    qk_norm = True
    moe = Moe(dense_layers=True, peft_fused=model_types)
