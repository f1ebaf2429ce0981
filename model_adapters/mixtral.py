"""Mixtral (``MixtralForCausalLM``): Llama attention + a top-k mixture of SwiGLU experts.

On disk (as ``save_pretrained`` writes it and hub checkpoints have it):
``model.layers.N.block_sparse_moe.gate.weight`` (router, [experts, hidden]) and
``model.layers.N.block_sparse_moe.experts.E.w1/w3/w2.weight`` (gate / up / down). In megatron-core
expert E of layer N lives on EP rank ``E // (experts/ep)`` as
``decoder.layers.N.mlp.experts.local_experts.<E mod experts/ep>.linear_fc1.weight``
(``[w1 shard; w3 shard]`` per expert-TP rank) and ``linear_fc2.weight`` (w2, split by input).

Routing: HF takes softmax over all experts, then top-k, then renormalises the k weights, which
equals megatron-core's default top-k-then-softmax (``moe_router_pre_softmax=False``). Experts are
dropless (no capacity factor). The token dispatcher is ``allgather`` (works on gloo and NCCL;
pass ``moe_token_dispatcher_type="alltoall"`` to ``load_hf`` on GPUs for large EP).
"""

from __future__ import annotations

from toolkit.adapters import Family, Moe, register


@register
class Mixtral(Family):
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    moe = Moe(experts_key=("num_local_experts", "num_experts"), ffn_key="intermediate_size",
              block="block_sparse_moe.", expert_names=("w1", "w3", "w2"), renormalise=True,
              jitter=True)
    defaults = {**Family.defaults, "rms_norm_eps": 1e-5}
