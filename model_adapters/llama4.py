"""Llama 4 text model (``Llama4ForCausalLM``; the vision tower is out of scope). RoPE layers
(complex-pair RoPE) attend in chunks, q/k L2-normalised after RoPE; NoPE layers attend to the
whole prefix with attention-temperature tuning (``toolkit.models.llama4``). MoE layers route
top-1 by sigmoid(logit), scale each token *before* its expert and add an ungated shared expert;
the others have a dense MLP (``intermediate_size_mlp``). Experts are stored stacked
(``[experts, in, out]``). No aux loss (HF has none). Refused: top-k > 1, biases, cp > 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from toolkit.adapters import Dims, Family, Moe, UnsupportedModel, register
from toolkit.adapters.hfconfig import COUNTS, Kind
from toolkit.adapters.hybrid import llama4_layers
from toolkit.mapping import builders, fused_builders


@register
class Llama4Text(Family):
    architectures = ("Llama4ForCausalLM",)
    model_types = ("llama4_text",)
    defaults = {**Family.defaults, "rms_norm_eps": 1e-5, "head_dim": 128,
                "intermediate_size_mlp": 16384, "num_experts_per_tok": 1, "use_qk_norm": True,
                "attention_chunk_size": 8192, "attn_temperature_tuning": True,
                "floor_scale": 8192, "attn_scale": 0.1}
    moe = Moe(experts_key="num_local_experts", ffn_key="intermediate_size",
              block="feed_forward.", renormalise=False)
    refuses_cp = "mdtk's context-parallel attention has no chunked attention"

    def fields(self) -> dict[str, Kind]:
        return {**super().fields(), "no_rope_layers": COUNTS, "moe_layers": COUNTS}

    def dims(self, hf: Any) -> Dims:
        d, moe = super().dims(hf), llama4_layers(hf, self.value(hf, "num_hidden_layers")).moe
        return dataclasses.replace(
            d, dense_ffn=self.value(hf, "intermediate_size_mlp"), shared_ffn=d.ffn,
            dense_layers=tuple(i for i in range(d.layers) if i not in moe))

    def check(self, hf: Any) -> None:
        for key, ok, why in (
                ("num_experts_per_tok", self.value(hf, "num_experts_per_tok") == 1, "Llama 4 "
                 "scales tokens before their expert: megatron-core does it for top-1 only"),
                ("moe_layers", llama4_layers(hf, self.dims(hf).layers).moe, "megatron-core "
                 "needs at least one MoE layer in a MoE model")):
            if not ok:
                raise UnsupportedModel(f"{key}={getattr(hf, key, None)}: {why}.")
        super().check(hf)

    def transformer_kwargs(self, hf: Any) -> dict[str, Any]:
        d, kinds = self.dims(hf), llama4_layers(hf, self.value(hf, "num_hidden_layers"))
        return {**super().transformer_kwargs(hf), "rotary_interleaved": True,
                "no_rope_freq": [int(i not in kinds.rope) for i in range(d.layers)],
                "moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
                "moe_apply_probs_on_input": True, "moe_router_load_balancing_type": "none",
                "moe_aux_loss_coeff": 0.0, "moe_shared_expert_intermediate_size": d.shared_ffn,
                "moe_shared_expert_gate": False}

    def spec_kwargs(self, hf: Any) -> dict[str, Any]:
        v, kinds = self.value, llama4_layers(hf, self.value(hf, "num_hidden_layers"))
        nope = tuple(i for i in range(self.value(hf, "num_hidden_layers")) if i not in kinds.rope)
        return {**super().spec_kwargs(hf), "llama4_attention": {
            "chunk": v(hf, "attention_chunk_size", None), "chunked": kinds.chunked,
            "l2_norm": kinds.rope if v(hf, "use_qk_norm") else (),
            "temperature": (float(v(hf, "floor_scale")), float(v(hf, "attn_scale"))),
            "tuned": nope if v(hf, "attn_temperature_tuning") else ()}}

    def mlp_rules(self, d: Dims, i: int, p: str) -> builders.Rules:
        f = p + "feed_forward."
        if i in d.dense_layers:
            return builders.gated_mlp(f, d.hidden, d.dense_ffn)
        return {**builders.router(f + "router.weight", d),
                **builders.shared_experts(f + "shared_expert.", None, d.hidden, d.shared_ffn)}

    def expert_rules(self, d: Dims, i: int) -> list[builders.Rules]:
        if i in d.dense_layers:
            return []
        block = f"{self.layer.format(i=i)}feed_forward.experts."
        return fused_builders.stacked_experts(block, d.experts, d.hidden, d.ffn)
