"""Qwen1.5-MoE / Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2 attention + routed and shared experts.

On disk (``save_pretrained`` output, hub checkpoints), per layer N:
``mlp.gate.weight`` (router, [experts, hidden]), ``mlp.experts.E.gate_proj/up_proj/down_proj``
(``moe_intermediate_size``), ``mlp.shared_expert.gate_proj/up_proj/down_proj``
(``shared_expert_intermediate_size``) and ``mlp.shared_expert_gate.weight`` ([1, hidden]).
In megatron-core: ``mlp.router.weight``, ``mlp.experts.local_experts.<e>.linear_fc1/fc2``,
``mlp.shared_experts.linear_fc1/fc2`` (split over TP like a dense MLP) and
``mlp.shared_experts.gate_weight`` ([1, hidden], replicated; enabled by
``moe_shared_expert_gate``): both compute ``sigmoid(x @ gate^T) * shared_mlp(x)``.

Routing: HF takes the softmax over all experts, then the top-k; ``norm_topk_prob=False`` (the
released checkpoints) keeps those k probabilities as they are, which is megatron-core's
``moe_router_pre_softmax=True``; ``norm_topk_prob=True`` renormalises them, which equals
megatron-core's top-k-then-softmax (``moe_router_pre_softmax=False``).

Layers with a dense MLP (``mlp_only_layers``, ``decoder_sparse_step`` != 1; HF's rule in
``toolkit.adapters.hfconfig.dense_layers``) become megatron-core's ``moe_layer_freq`` list; they
read ``mlp.gate_proj/up_proj/down_proj`` of size ``intermediate_size`` (megatron-core's
``ffn_hidden_size``). A model without any sparse layer is refused (it is a dense Qwen2/Qwen3
model; convert its config). q/k/v biases follow ``qkv_bias`` (default true); no other bias.
"""

from __future__ import annotations

from toolkit.adapters import Family, Moe, register


@register
class Qwen2Moe(Family):
    architectures = ("Qwen2MoeForCausalLM",)
    model_types = ("qwen2_moe",)
    defaults = {**Family.defaults, "qkv_bias": True, "norm_topk_prob": False}
    qkv_bias = "qkv_bias"
    linear_bias = mlp_bias = False
    moe = Moe(shared=True, dense_layers=True)
