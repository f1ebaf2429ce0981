"""Activation bytes per rank: Korthikanti et al. (2022), generalised to GQA, SwiGLU and MoE.

For GPT-3-like layers (MHA, 4h GeLU MLP, dropout) a layer stores s*b*h*(34 + 5*a*s/h) bytes in
16-bit; the terms are rebuilt here one saved tensor at a time, so that grouped-query attention,
gated MLPs, ffn != 4h, no-dropout models (Llama) and MoE get their own sizes:

attention: norm input, QKV input, Q, K, V, [scores: softmax output, dropout mask + output],
           output-projection input, [dropout mask]
mlp:       norm input, fc1 input, activation input, fc2 input, [dropout mask]

With tensor parallelism the norm inputs, the inputs of the column-parallel linears and the hidden
dropout masks stay whole on each rank unless sequence parallelism splits them too. Flash attention
(and selective recompute) drop the score terms. Full recompute keeps only each layer's input and
rebuilds one layer at a time. Context parallelism divides the sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.memory.model import ModelShape
from toolkit.memory.states import DTYPE_BYTES, RankParams
from toolkit.parallel.layout import ParallelLayout

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class TrainShape:
    """What one optimizer step looks like."""

    seq_len: int = 4096
    micro_batch: int = 1
    global_batch: int | None = None  # None = micro_batch * dp (no accumulation)
    dtype: str = "bf16"
    recompute: str = "none"
    flash_attention: bool = True
    dropout: bool = False  # Llama-style models train without dropout
    capacity_factor: float | None = None  # MoE: None = dropless (average load)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}: use bf16, fp16 or fp32.")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: use {', '.join(RECOMPUTE)}.")
        if self.seq_len < 1 or self.micro_batch < 1:
            raise ValueError(f"seq_len={self.seq_len} and micro_batch={self.micro_batch} must be "
                             ">= 1.")
        if self.global_batch is not None and self.global_batch < self.micro_batch:
            raise ValueError(f"global_batch={self.global_batch} is smaller than "
                             f"micro_batch={self.micro_batch}.")


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one layer keeps for backward, split into what TP divides and what it does not."""

    whole: float  # norm inputs, column-linear inputs, hidden dropout masks (divided only by SP)
    split: float  # everything inside the TP-parallel region
    scores: float  # attention scores (softmax out, dropout): removed by flash / selective

    def total(self, tp: int, sp: bool, keep_scores: bool) -> float:
        whole = self.whole / tp if sp else self.whole
        return whole + (self.split + (self.scores if keep_scores else 0.0)) / tp


def layer_activations(model: ModelShape, train: TrainShape, layer: int, *, cp: int = 1,
                      ep: int = 1) -> LayerActivations:
    """Korthikanti's per-layer terms for one micro-batch, before any TP division."""
    del ep  # experts on other EP ranks process tokens routed there; see the MoE note below
    e = DTYPE_BYTES[train.dtype]
    s, b, h = train.seq_len / cp, train.micro_batch, model.hidden
    sb = s * b
    mask = 1 if train.dropout else 0
    # attention block
    whole = e * sb * h * 2 + mask * sb * h  # norm input + QKV input, output dropout mask
    split = e * sb * (model.q_dim + 2 * model.kv_dim)  # Q, K, V
    split += e * sb * model.q_dim  # output projection input (= attention output)
    scores = e * model.heads * s * train.seq_len * b  # softmax output
    if train.dropout:
        scores += (1 + e) * model.heads * s * train.seq_len * b  # dropout mask and output
    # MLP block
    whole += e * sb * h + mask * sb * h  # norm input, dropout mask
    if model.is_moe_layer(layer):
        # Router input and logits, then each token's copy for each of its top-k experts: under
        # EP every rank processes (on average) s*b*k token copies for its local experts.
        cf = train.capacity_factor or 1.0
        tokens = sb * model.top_k * cf
        whole += e * sb * h + 4 * sb * model.experts  # router input, fp32 router logits
        split += _mlp_saved(model, model.moe_ffn, tokens, e)
        if model.shared_ffn:
            whole += e * sb * h
            split += _mlp_saved(model, model.shared_ffn, sb, e)
    else:
        whole += e * sb * h  # fc1 input
        split += _mlp_saved(model, model.ffn, sb, e) - e * sb * h
    return LayerActivations(whole=whole, split=split, scores=scores)


def _mlp_saved(model: ModelShape, ffn: int, tokens: float, e: int) -> float:
    """fc1 input, activation input (gate and up for gated MLPs), fc2 input."""
    act_in = (2 if model.gated_mlp else 1) * ffn
    return e * tokens * (model.hidden + act_in + ffn)


def in_flight_microbatches(layout: ParallelLayout, stage: int, num_microbatches: int) -> float:
    """1F1B: stage i holds pp - i micro-batches; interleaving adds (pp-1)/(pp*vpp) on stage 0."""
    held = min(layout.pp - stage, num_microbatches)
    if layout.vpp and layout.vpp > 1 and stage == 0:
        held = math.ceil((1 + (layout.pp - 1) / (layout.pp * layout.vpp)) * layout.pp)
        held = min(held, num_microbatches * layout.vpp)
    return max(1, held)


def activation_bytes(model: ModelShape, train: TrainShape, layout: ParallelLayout,
                     params: RankParams, stage: int, num_microbatches: int) -> dict[str, float]:
    """Activation bytes on pipeline rank ``stage``: stored layers, recompute working set,
    embedding / logits. Keys are breakdown lines."""
    tp, sp, cp = layout.tp, layout.sequence_parallel, layout.cp
    e = DTYPE_BYTES[train.dtype]
    eager = not train.flash_attention
    keep_scores = eager and train.recompute == "none"
    sb = train.seq_len / cp * train.micro_batch
    per_layer = [layer_activations(model, train, i, cp=cp, ep=layout.ep) for i in params.layers]
    full = [a.total(tp, sp, keep_scores=eager) for a in per_layer]
    if train.recompute == "full":
        stored = sum(e * sb * model.hidden / (tp if sp else 1) for _ in per_layer)
    else:
        stored = sum(a.total(tp, sp, keep_scores) for a in per_layer)
    held = in_flight_microbatches(layout, stage, num_microbatches)
    out = {f"activations ({len(per_layer)} layers x {held:g} micro-batches in flight)":
           stored * held}
    if train.recompute != "none" and full:
        out["recompute working set (one layer)"] = max(full)
    vocab = model.padded_vocab(tp) if tp > 1 else model.vocab
    if stage == layout.pp - 1:
        # final norm input, output-layer input, logits (16-bit) and their fp32 softmax for the loss
        whole = 2 * e * sb * model.hidden
        out["final norm, logits and loss"] = (
            (whole / tp if sp else whole) + (e + 4) * sb * vocab / tp
        )
    return out
