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

Layers with a dense MLP (``mlp_only_layers``, ``decoder_sparse_step`` != 1; HF's rule: layer i
is sparse iff ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step
== 0``) become megatron-core's ``moe_layer_freq`` list; they read ``mlp.gate_proj/up_proj/
down_proj`` of size ``intermediate_size`` (megatron-core's ``ffn_hidden_size``). A model without
any sparse layer is refused (it is a dense Qwen2/Qwen3 model; convert its config).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model_adapters import register
from model_adapters.llama import Llama
from toolkit.adapters import Dims, UnsupportedModel
from toolkit.mapping import GateUp, Part, Replicated, Row, Rule


def dense_layers(hf: Any) -> list[int]:
    """Layers HF builds with a dense MLP instead of the sparse block (its decoder layer rule)."""
    only = set(getattr(hf, "mlp_only_layers", None) or [])
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return [i for i in range(hf.num_hidden_layers)
            if i in only or not (hf.num_experts > 0 and (i + 1) % step == 0)]


@register
class Qwen2Moe(Llama):
    architectures = ("Qwen2MoeForCausalLM",)
    shared_expert = True  # shared expert MLP with a sigmoid gate in every MoE layer

    def biases(self, hf: Any) -> tuple[bool, bool]:
        return bool(getattr(hf, "qkv_bias", True)), False

    def check(self, hf: Any) -> None:
        super().check(hf)
        if len(dense_layers(hf)) == hf.num_hidden_layers:
            raise UnsupportedModel(
                f"num_experts={hf.num_experts}, mlp_only_layers="
                f"{list(getattr(hf, 'mlp_only_layers', None) or [])}, decoder_sparse_step="
                f"{getattr(hf, 'decoder_sparse_step', 1)}: no layer is sparse; megatron-core "
                "needs at least one MoE layer in a MoE model."
            )
        if hf.num_experts_per_tok == 1 and hf.norm_topk_prob:
            raise UnsupportedModel(
                "num_experts_per_tok=1 with norm_topk_prob=True (every routing weight is 1): "
                "megatron-core refuses top-1 routing without moe_router_pre_softmax."
            )
        if self.shared_expert and not hf.shared_expert_intermediate_size > 0:
            raise UnsupportedModel(
                f"shared_expert_intermediate_size={hf.shared_expert_intermediate_size}: "
                "megatron-core's shared expert needs a positive size."
            )

    def dims(self, hf: Any) -> Dims:
        return dataclasses.replace(super().dims(hf), ffn=hf.moe_intermediate_size,
                                   experts=hf.num_experts)

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        shared = {"moe_shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
                  "moe_shared_expert_gate": True} if self.shared_expert else {}
        return {
            **super().transformer_kwargs(hf),
            "ffn_hidden_size": hf.intermediate_size,  # the dense layers' MLP
            "num_moe_experts": hf.num_experts,
            "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "moe_router_pre_softmax": not hf.norm_topk_prob,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(hf.router_aux_loss_coef),
            "moe_token_dispatcher_type": "allgather",
            **shared,
            **self.layer_freq(hf),
        }

    def layer_freq(self, hf: Any) -> dict[str, Any]:
        dense = dense_layers(hf)
        if not dense:
            return {}
        return {"moe_layer_freq": [int(i not in dense) for i in range(hf.num_hidden_layers)]}

    def spec_kwargs(self, hf: Any) -> dict[str, Any]:
        return {**super().spec_kwargs(hf), "num_experts": hf.num_experts}

    def mlp_rules(self, hf: Any, d: Dims, p: str) -> dict[str, Rule]:
        m = f"{p}mlp."
        rules: dict[str, Rule] = {
            "mlp.router.weight": Replicated(m + "gate.weight", (d.experts, d.hidden)),
        }
        if self.shared_expert:
            s, ffn = m + "shared_expert.", hf.shared_expert_intermediate_size
            rules.update({
                "mlp.shared_experts.linear_fc1.weight": GateUp(
                    Part(s + "gate_proj.weight"), Part(s + "up_proj.weight"), ffn, inn=d.hidden),
                "mlp.shared_experts.linear_fc2.weight": Row(s + "down_proj.weight", d.hidden, ffn),
                "mlp.shared_experts.gate_weight": Replicated(m + "shared_expert_gate.weight",
                                                             (1, d.hidden)),
            })
        return rules

    def layer_rules(self, hf: Any, d: Dims, i: int) -> dict[str, Rule]:
        rules = super().layer_rules(hf, d, i)
        if i not in dense_layers(hf):
            return rules
        p = f"model.layers.{i}."
        moe = self.mlp_rules(hf, d, p)
        dense = Llama.mlp_rules(self, hf, dataclasses.replace(d, ffn=hf.intermediate_size), p)
        return {**{k: r for k, r in rules.items() if k not in moe}, **dense}

    def expert_rules(self, hf: Any, d: Dims, i: int) -> list[dict[str, Rule]]:
        if i in dense_layers(hf):
            return []
        rules = []
        for e in range(d.experts):
            x = f"model.layers.{i}.mlp.experts.{e}."
            rules.append({
                "linear_fc1.weight": GateUp(Part(x + "gate_proj.weight"),
                                            Part(x + "up_proj.weight"), d.ffn, inn=d.hidden),
                "linear_fc2.weight": Row(x + "down_proj.weight", d.hidden, d.ffn),
            })
        return rules
