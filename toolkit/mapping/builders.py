"""Rule builders shared by the families: one function per block that several architectures have.

Each returns the rules of one block keyed by megatron-core name (suffixes after
``decoder.layers.<i>.``, or after ``...local_experts.<e>.`` for an expert), with every shape
filled from the model's sizes, so a family names only its HF tensors. Sizes come from any object
with the attributes of ``Sizes`` (the adapters' ``Dims``); this layer imports nothing above it.
"""

from __future__ import annotations

from typing import Protocol

from toolkit.mapping.rules import QKV, Column, GateUp, Part, Replicated, Row, Rule

Rules = dict[str, Rule]
SWIGLU = ("gate_proj", "up_proj", "down_proj")  # HF's names of a gated MLP's projections


class Sizes(Protocol):
    hidden: int
    heads: int
    groups: int
    head_dim: int
    experts: int
    norm: str
    qkv_bias: bool
    linear_bias: bool
    qk_norm: bool


def norm(name: str, source: str, d: Sizes) -> Rules:
    """A norm's weight (and bias for LayerNorm); ``source`` is the HF module prefix."""
    rules: Rules = {f"{name}.weight": Replicated(source + "weight", (d.hidden,))}
    if d.norm == "LayerNorm":
        rules[f"{name}.bias"] = Replicated(source + "bias", (d.hidden,))
    return rules


def attention(a: str, d: Sizes) -> Rules:
    """GQA attention from separate ``q_proj/k_proj/v_proj/o_proj`` (``nn.Linear``) under ``a``,
    with q/k/v biases, the o_proj bias and RMSNorm over ``head_dim`` on q and k as ``d`` says."""
    def qkv(kind: str, inn: int | None) -> QKV:
        return QKV(*(Part(f"{a}{x}_proj.{kind}") for x in "qkv"), d.heads, d.groups,
                   d.head_dim, inn=inn)

    q_dim = d.heads * d.head_dim
    rules: Rules = {"self_attention.linear_qkv.weight": qkv("weight", d.hidden),
                    "self_attention.linear_proj.weight": Row(a + "o_proj.weight", d.hidden,
                                                             q_dim)}
    if d.qkv_bias:
        rules["self_attention.linear_qkv.bias"] = qkv("bias", None)
    if d.linear_bias:
        rules["self_attention.linear_proj.bias"] = Replicated(a + "o_proj.bias", (d.hidden,))
    if d.qk_norm:
        for x in "qk":
            rules[f"self_attention.{x}_layernorm.weight"] = Replicated(f"{a}{x}_norm.weight",
                                                                       (d.head_dim,))
    return rules


def fused_attention(qkv: str, proj: str, d: Sizes, *, transpose: bool = False) -> Rules:
    """Attention whose q, k and v sit side by side in one stored tensor ``qkv`` (GPT-2's
    ``c_attn``; ``transpose`` for HF ``Conv1D``'s ``[in, out]``), output projection ``proj``."""
    q_dim, kv_dim = d.heads * d.head_dim, d.groups * d.head_dim
    offsets = (0, q_dim, q_dim + kv_dim)

    def parts(kind: str) -> list[Part]:
        return [Part(f"{qkv}.{kind}", o) for o in offsets]

    rules: Rules = {"self_attention.linear_qkv.weight": QKV(
        *parts("weight"), d.heads, d.groups, d.head_dim, inn=d.hidden, transpose=transpose)}
    if d.qkv_bias:
        rules["self_attention.linear_qkv.bias"] = QKV(*parts("bias"), d.heads, d.groups,
                                                      d.head_dim)
    rules["self_attention.linear_proj.weight"] = Row(f"{proj}.weight", d.hidden, q_dim,
                                                     transpose=transpose)
    if d.linear_bias:
        rules["self_attention.linear_proj.bias"] = Replicated(f"{proj}.bias", (d.hidden,))
    return rules


def gated_mlp(m: str, hidden: int, ffn: int, *, names: tuple[str, str, str] = SWIGLU,
              bias: bool = False, to: str = "mlp.") -> Rules:
    """SwiGLU MLP: HF ``gate/up/down`` projections (``names``) under ``m`` as megatron-core's
    ``linear_fc1`` ([gate; up] per shard) and ``linear_fc2`` under ``to`` ("" for an expert)."""
    gate, up, down = (f"{m}{n}." for n in names)
    rules: Rules = {
        f"{to}linear_fc1.weight": GateUp(Part(gate + "weight"), Part(up + "weight"), ffn,
                                         inn=hidden),
        f"{to}linear_fc2.weight": Row(down + "weight", hidden, ffn),
    }
    if bias:
        rules[f"{to}linear_fc1.bias"] = GateUp(Part(gate + "bias"), Part(up + "bias"), ffn)
        rules[f"{to}linear_fc2.bias"] = Replicated(down + "bias", (hidden,))
    return rules


def fused_gated_mlp(gate_up: str, down: str, hidden: int, ffn: int) -> Rules:
    """Gated MLP whose gate and up projections are one stored ``[2 * ffn, hidden]`` tensor
    ``gate_up`` (gate rows first; Phi-3's ``gate_up_proj``), read as two parts of it."""
    return {"mlp.linear_fc1.weight": GateUp(Part(f"{gate_up}.weight"),
                                            Part(f"{gate_up}.weight", ffn), ffn, inn=hidden),
            "mlp.linear_fc2.weight": Row(f"{down}.weight", hidden, ffn)}


def mlp(fc1: str, fc2: str, hidden: int, ffn: int, *, bias: bool = False,
        transpose: bool = False) -> Rules:
    """Plain (ungated) MLP: up projection ``fc1``, down projection ``fc2`` (HF module names)."""
    rules: Rules = {"mlp.linear_fc1.weight": Column(f"{fc1}.weight", ffn, hidden,
                                                    transpose=transpose)}
    if bias:
        rules["mlp.linear_fc1.bias"] = Column(f"{fc1}.bias", ffn)
    rules["mlp.linear_fc2.weight"] = Row(f"{fc2}.weight", hidden, ffn, transpose=transpose)
    if bias:
        rules["mlp.linear_fc2.bias"] = Replicated(f"{fc2}.bias", (hidden,))
    return rules


def router(source: str, d: Sizes) -> Rules:
    """The MoE router (``[experts, hidden]``, replicated)."""
    return {"mlp.router.weight": Replicated(source, (d.experts, d.hidden))}


def scored_router(gate: str, d: Sizes) -> Rules:
    """A router choosing experts by scores plus a stored per-expert correction bias (DeepSeek-V3's
    ``gate.e_score_correction_bias`` under the module ``gate``: megatron-core's
    ``router.expert_bias`` buffer)."""
    return {**router(gate + "weight", d),
            "mlp.router.expert_bias": Replicated(gate + "e_score_correction_bias", (d.experts,))}


def shared_experts(s: str, gate: str | None, hidden: int, ffn: int) -> Rules:
    """A shared expert (SwiGLU under ``s``, split over TP like a dense MLP) and, when ``gate``
    names one, its sigmoid gate ``[1, hidden]`` (megatron-core's ``moe_shared_expert_gate``)."""
    rules = gated_mlp(s, hidden, ffn, to="mlp.shared_experts.")
    if gate:
        rules["mlp.shared_experts.gate_weight"] = Replicated(gate, (1, hidden))
    return rules


def experts(block: str, count: int, hidden: int, ffn: int,
            names: tuple[str, str, str] = SWIGLU, *, bias: bool = False) -> list[Rules]:
    """Routed SwiGLU experts ``{block}{e}.<names>`` (split by expert-TP), one dict per expert;
    ``bias``: each projection's bias too (GPT-OSS)."""
    return [gated_mlp(f"{block}{e}.", hidden, ffn, names=names, bias=bias, to="")
            for e in range(count)]


def mla_attention(a: str, hidden: int, heads: int, q_lora: int, kv_lora: int, qk_nope: int,
                  qk_rope: int, v_dim: int) -> Rules:
    """Multi-latent attention (DeepSeek-V2/V3) under ``a``: megatron-core's ``MLASelfAttention``.

    The down projections ``q_a_proj`` / ``kv_a_proj_with_mqa`` are column-parallel in
    megatron-core's local spec (split over TP, gathered after), the up projections
    ``q_b_proj`` / ``kv_b_proj`` store heads one after another (``[nope; rope]`` per query head,
    ``[k_nope; v]`` per key/value head) and are split by heads; ``q_lora=0``: one ``q_proj``.
    """
    q_head, s = qk_nope + qk_rope, "self_attention."
    rules: Rules = {
        f"{s}linear_kv_down_proj.weight": Column(a + "kv_a_proj_with_mqa.weight",
                                                 kv_lora + qk_rope, hidden),
        f"{s}kv_layernorm.weight": Replicated(a + "kv_a_layernorm.weight", (kv_lora,)),
        f"{s}linear_kv_up_proj.weight": Column(a + "kv_b_proj.weight", heads * (qk_nope + v_dim),
                                               kv_lora),
        f"{s}linear_proj.weight": Row(a + "o_proj.weight", hidden, heads * v_dim)}
    if not q_lora:
        return {**rules, f"{s}linear_q_proj.weight": Column(a + "q_proj.weight", heads * q_head,
                                                            hidden)}
    return {**rules,
            f"{s}linear_q_down_proj.weight": Column(a + "q_a_proj.weight", q_lora, hidden),
            f"{s}q_layernorm.weight": Replicated(a + "q_a_layernorm.weight", (q_lora,)),
            f"{s}linear_q_up_proj.weight": Column(a + "q_b_proj.weight", heads * q_head, q_lora)}
