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

import dataclasses
from typing import Any

from model_adapters import register
from model_adapters.llama import Llama
from toolkit.adapters import Dims
from toolkit.mapping import GateUp, Part, Replicated, Row, Rule


@register
class Mixtral(Llama):
    architectures = ("MixtralForCausalLM",)

    def dims(self, hf: Any) -> Dims:
        return dataclasses.replace(super().dims(hf), experts=hf.num_local_experts)

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        jitter = float(getattr(hf, "router_jitter_noise", 0.0) or 0.0)
        return {
            **super().transformer_kwargs(hf),
            "num_moe_experts": hf.num_local_experts,
            "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.intermediate_size,
            "moe_router_pre_softmax": False,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(hf.router_aux_loss_coef),
            "moe_token_dispatcher_type": "allgather",
            "moe_input_jitter_eps": jitter or None,
        }

    def spec_kwargs(self, hf: Any) -> dict[str, Any]:
        return {**super().spec_kwargs(hf), "num_experts": hf.num_local_experts}

    def mlp_rules(self, hf: Any, d: Dims, p: str) -> dict[str, Rule]:
        return {"mlp.router.weight": Replicated(p + "block_sparse_moe.gate.weight",
                                                (d.experts, d.hidden))}

    def expert_rules(self, hf: Any, d: Dims, i: int) -> list[dict[str, Rule]]:
        rules = []
        for e in range(d.experts):
            x = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            rules.append({
                "linear_fc1.weight": GateUp(Part(x + "w1.weight"), Part(x + "w3.weight"), d.ffn,
                                            inn=d.hidden),
                "linear_fc2.weight": Row(x + "w2.weight", d.hidden, d.ffn),
            })
        return rules
