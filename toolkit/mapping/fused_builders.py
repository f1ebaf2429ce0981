"""Rule builders for fused HF tensors that ``builders`` does not cover: Qwen3-Next's gated
attention and gated DeltaNet, and experts stored stacked in one 3-D tensor (Llama 4).

As in ``builders``, each returns megatron-core suffixes (after ``decoder.layers.<i>.`` or after
``...local_experts.<e>.``) and fills every shape from the model's sizes (an object with the
attributes of ``builders.Sizes``, plus ``delta`` for the DeltaNet: the adapters' ``Dims``).
"""

from __future__ import annotations

from typing import Any

from toolkit.mapping import builders
from toolkit.mapping.grouped import Block, Grouped, Stacked
from toolkit.mapping.rules import Column, GateUp, Part, Replicated, Row


def gated_attention(a: str, d: Any) -> builders.Rules:
    """GQA attention whose ``q_proj`` holds, head by head, a query and a sigmoid output gate
    (``[q_h; gate_h]``, ``2 * head_dim`` rows each): megatron-core's ``attention_output_gate``,
    whose ``linear_qkv`` holds per query group ``[q heads; gate heads; k; v]``."""
    per, hd = d.heads // d.groups, d.head_dim
    q = f"{a}q_proj.weight"
    qkv = Grouped((Block(q, 0, 2 * per * hd, hd, per, 2 * hd),
                   Block(q, hd, 2 * per * hd, hd, per, 2 * hd),
                   Block(f"{a}k_proj.weight", 0, hd, hd), Block(f"{a}v_proj.weight", 0, hd, hd)),
                  d.groups, (d.hidden,))
    return {**builders.attention(a, d), "self_attention.linear_qkv.weight": qkv}


def gated_delta_net(a: str, d: Any) -> builders.Rules:
    """Qwen3-Next's ``linear_attn`` (HF: ``in_proj_qkvz`` with ``[q; k; v; z]`` per key head,
    ``in_proj_ba`` with ``[b; a]`` per key head, ``conv1d`` over ``[q; k; v]`` of all heads) as
    ``toolkit.models.delta_net.GatedDeltaNet`` (every tensor laid out per key-head group)."""
    n = d.delta
    r = n.v_heads // n.k_heads
    qkvz = 2 * n.k_dim + 2 * r * n.v_dim
    conv = f"{a}conv1d.weight"
    kq = n.k_heads * n.k_dim
    return {
        "self_attention.in_proj.weight": Grouped(
            (Block(f"{a}in_proj_qkvz.weight", 0, qkvz, qkvz),
             Block(f"{a}in_proj_ba.weight", 0, 2 * r, 2 * r)), n.k_heads, (d.hidden,)),
        "self_attention.conv1d.weight": Grouped(
            (Block(conv, 0, n.k_dim, n.k_dim), Block(conv, kq, n.k_dim, n.k_dim),
             Block(conv, 2 * kq, r * n.v_dim, r * n.v_dim)), n.k_heads, (1, n.kernel)),
        "self_attention.dt_bias": Column(f"{a}dt_bias", n.v_heads),
        "self_attention.A_log": Column(f"{a}A_log", n.v_heads),
        "self_attention.out_norm.weight": Replicated(f"{a}norm.weight", (n.v_dim,)),
        "self_attention.out_proj.weight": Row(f"{a}out_proj.weight", d.hidden,
                                              n.v_heads * n.v_dim),
    }


def stacked_experts(block: str, count: int, hidden: int, ffn: int) -> list[builders.Rules]:
    """Routed SwiGLU experts stored as ``{block}gate_up_proj [experts, hidden, 2 * ffn]``
    (gate columns first) and ``{block}down_proj [experts, ffn, hidden]``, both ``[in, out]``
    per expert (Llama 4), one dict per expert (split by expert-TP)."""
    gate_up, down = f"{block}gate_up_proj", f"{block}down_proj"
    fc1 = GateUp(Part(gate_up), Part(gate_up, ffn), ffn, inn=hidden, transpose=True)
    fc2 = Row(down, hidden, ffn, transpose=True)
    return [{"linear_fc1.weight": Stacked(fc1, e, count),
             "linear_fc2.weight": Stacked(fc2, e, count)} for e in range(count)]
