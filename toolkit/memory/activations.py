"""Activation bytes per rank: Korthikanti et al. (2022), generalised to GQA, SwiGLU, RoPE and MoE.

For GPT-3-like layers (MHA, learned positions, 4h GeLU MLP, dropout) a layer stores
s*b*h*(34 + 5*a*s/h) bytes in 16-bit; the terms are rebuilt here one saved tensor at a time, so
that grouped-query attention, RoPE, gated MLPs, ffn != 4h, no-dropout models (Llama) and MoE get
their own sizes. The tensors are those megatron-core's attention and MLP really save (checked
against a GPTModel with saved-tensor hooks, tests/test_memory_activations.py):

attention: norm input, QKV input, Q, K, V, [eager core attention: softmax output, dropout mask
           and output], output-projection input, [dropout mask]
mlp:       norm input, fc1 input, activation input, fc2 input, [dropout mask]

Q, K and V: RoPE writes new Q and K tensors, while V stays a view of the QKV projection's output,
which it keeps alive whole (q + 2 kv wide). Without RoPE all three are views of that buffer.
Eager attention with grouped-query heads saves K and V repeated to every query head instead.

With tensor parallelism the norm inputs, the inputs of the column-parallel linears and the hidden
dropout masks stay whole on each rank unless sequence parallelism splits them too. Flash attention
and selective recompute (megatron-core's default ``core_attn``) drop the core-attention terms.
Full recompute keeps only each layer's input and rebuilds one layer at a time. Context
parallelism divides the sequence, except for K and V: mdtk's CP attention all-gathers them over
the CP group and keeps the whole-sequence copies for backward (2 * seq * kv_dim a layer on every
CP rank). It keeps Q, its own output and an fp32 LSE per head and token, not the local K or the
QKV buffer (they only feed the gather), and never an s x s or chunk x prefix tensor: on CPU it
merges a square causal flash block with an unmasked flash prefix by log-sum-exp (measured with
saved-tensor hooks at cp=1 and cp=2, tests/test_memory_activations.py). Not modelled: the CP
fallback for explicit padding masks or attention dropout, which keeps a boolean chunk x prefix
mask.

``fused=False`` models megatron-core's unfused path (the local spec with fusions off, as mdtk
builds it, running on CPU): RMSNorm keeps its normalised input too (torch's CPU rms_norm is
composite), SwiGLU keeps silu(gate) and its linear half, RoPE keeps its cos/sin tables per layer,
the unfused softmax keeps the causal mask, and dropout keeps an e-byte noise tensor instead of a
1-byte mask. Per-token norm statistics (4-8 bytes a token) are left out everywhere.

Gated DeltaNet layers (Qwen3-Next's linear attention) replace the attention terms with what the
CUDA kernels keep (``_delta_saved``): linear in the sequence, plus the fp32 recurrent state at
every 64-token chunk boundary. This term is counted from the kernels' saved tensors, not
measured with hooks (the CPU fallback keeps more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit import rules
from toolkit.errors import ConfigError
from toolkit.memory.model import ModelShape
from toolkit.memory.states import DTYPE_BYTES, RankParams, rank_params
from toolkit.parallel.layout import ParallelLayout, ResolvedLayout

#: GRPO's loss (``token_logps``) keeps a second fp32 tensor of the logits' size for backward
GRPO_LOSS_LINE = "loss: GRPO's fp32 log-probabilities (kept for backward)"

#: The chunk length of the chunked gated delta rule (fla's and transformers'; equals
#: ``toolkit.models.delta_net.CHUNK``, which this torch-free module cannot import).
DELTA_CHUNK = 64


@dataclass(frozen=True)
class TrainShape:
    """What one optimizer step looks like."""

    seq_len: int = 4096
    micro_batch: int = 1
    global_batch: int | None = None  # None = micro_batch * dp (no accumulation)
    dtype: str = "bf16"
    recompute: rules.Recompute = "none"
    flash_attention: bool = True
    dropout: bool = False  # Llama-style models train without dropout
    capacity_factor: float | None = None  # MoE: None = dropless (average load)
    fused: bool = True  # False: megatron-core's unfused kernels (mdtk's local spec on CPU)
    pairs: bool = False  # DPO: each sample is a chosen and a rejected sequence (2 rows)
    reference_model: bool = False  # DPO: a frozen reference copy of the weights is held
    async_checkpoint: bool = False  # a host copy of the rank's checkpoint files, kept for the run
    unpaired: bool = False  # KTO: one row a sample (its KL row runs forward only), a reference
    teacher: ModelShape | None = None  # distillation: a frozen teacher (and its step's logits)
    grpo: bool = False  # GRPO: prompt + completion rows (a reference with grpo.beta != 0)
    rollout_cache: bool = False  # GRPO generating on the training ranks: the engine's KV cache

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}: use bf16, fp16 or fp32.")
        if (problem := rules.recompute_problem(self.recompute)) is not None:
            raise ValueError(problem)
        if self.seq_len < 1 or self.micro_batch < 1:
            raise ValueError(f"seq_len={self.seq_len} and micro_batch={self.micro_batch} must be "
                             ">= 1.")
        if self.reference_model and not (self.pairs or self.unpaired or self.grpo):
            raise ValueError("a reference model (reference_model=True) is DPO's: set pairs=True "
                             "(or unpaired=True: KTO's, grpo=True: GRPO's).")
        if self.rollout_cache and not self.grpo:
            raise ValueError("a rollout KV cache (rollout_cache=True) is GRPO's generation "
                             "engine: set grpo=True.")
        if self.global_batch is not None and self.global_batch < self.micro_batch:
            raise ValueError(f"global_batch={self.global_batch} is smaller than "
                             f"micro_batch={self.micro_batch}.")

    @property
    def rows(self) -> int:
        """Sequences in one micro-batch (DPO: the chosen and the rejected row of each pair)."""
        return self.micro_batch * (2 if self.pairs else 1)

    @property
    def mask_bytes(self) -> int:
        """A dropout mask: CUDA's fused dropout keeps 1-byte booleans; the unfused (CPU) path
        multiplies by a noise tensor of the activation's dtype and keeps that."""
        return 1 if self.fused else DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one layer keeps for backward, split by how tensor parallelism divides them."""

    whole: float  # norm inputs, column-linear inputs, hidden dropout masks (divided only by SP)
    split: float  # everything inside the TP-parallel region (divided by TP)
    shared: float = 0.0  # the same on every TP rank (RoPE tables, causal mask): never divided

    def total(self, tp: int, sp: bool) -> float:
        whole = self.whole / tp if sp else self.whole
        return whole + self.split / tp + self.shared


def layer_activations(model: ModelShape, train: TrainShape, layer: int, *, cp: int = 1,
                      keep_core: bool | None = None) -> LayerActivations:
    """The per-layer terms of one micro-batch, before any TP division. ``keep_core``: the eager
    core attention's own tensors are stored (default: eager attention without recompute)."""
    if keep_core is None:  # the CP attention always runs SDPA: no s x s scores at cp > 1
        keep_core = not train.flash_attention and train.recompute == "none" and cp == 1
    e, m = DTYPE_BYTES[train.dtype], train.mask_bytes
    s, b, h = train.seq_len / cp, train.rows, model.hidden
    sb = s * b
    norm = e * sb * h * (1 if train.fused or model.norm != "rms" else 2)  # [+ normalised copy]
    hidden_mask = m * sb * h if train.dropout else 0
    # attention block
    whole = norm + e * sb * h + hidden_mask  # norm input, QKV input, output dropout mask
    if layer in model.delta_layers:
        split, shared = _delta_saved(model, s, b, e), 0.0
    else:
        split, shared = _attention_saved(model, train, s, b, cp, keep_core)
    # MLP block
    whole += norm + hidden_mask  # norm input, dropout mask
    if model.is_moe_layer(layer):
        # Router input and logits, then each token's copy for each of its top-k experts: under
        # EP every rank processes (on average) s*b*k token copies for its local experts.
        cf = train.capacity_factor or 1.0
        tokens = sb * model.top_k * cf
        whole += e * sb * h + 4 * sb * model.experts  # router input, fp32 router logits
        split += _mlp_saved(model, model.moe_ffn, tokens, e, train.fused)
        if model.shared_ffn:
            whole += e * sb * h
            split += _mlp_saved(model, model.shared_ffn, sb, e, train.fused)
    else:
        whole += e * sb * h  # fc1 input
        split += _mlp_saved(model, model.ffn, sb, e, train.fused) - e * sb * h
    return LayerActivations(whole=whole, split=split, shared=shared)


def _attention_saved(model: ModelShape, train: TrainShape, s: float, b: int, cp: int,
                     keep_core: bool) -> tuple[float, float]:
    """The attention's split and shared terms of one layer (see the module docstring)."""
    e, m, sb = DTYPE_BYTES[train.dtype], train.mask_bytes, s * b
    rope = not model.learned_positions
    mixed = model.q_dim + 2 * model.kv_dim  # the QKV projection's output, pinned by V
    qkv = model.q_dim + model.kv_dim + mixed if rope else mixed
    shared = 0.0
    if rope and not train.fused:
        shared += 4 * e * s * model.head_dim  # cos and sin, for Q and for K
    if keep_core:
        if model.heads > model.kv_heads:  # K, V repeated to every head replace K and the view
            qkv = 3 * model.q_dim if rope else mixed + 2 * model.q_dim
        scores = model.heads * s * train.seq_len * b
        split_scores = e * scores  # softmax output
        if train.dropout:
            split_scores += (m + e) * scores  # dropout mask and output
        if not train.fused:
            shared += s * train.seq_len  # the boolean causal mask of the unfused softmax
    else:
        split_scores = 0.0
    gathered_kv = 0.0
    if cp > 1:
        # mdtk's CP attention keeps Q (without RoPE: the QKV buffer it views), its own output,
        # an fp32 LSE per head and the all-gathered whole-sequence K and V; the local K and the
        # QKV buffer only feed the gather, which keeps nothing.
        qkv = (model.q_dim if rope else mixed) + model.q_dim + 4 * model.heads / e
        gathered_kv = e * train.seq_len * b * 2 * model.kv_dim
    gate = e * sb * model.q_dim if model.attn_gate else 0.0  # the output gate's input
    # ... + output projection input
    return e * sb * qkv + e * sb * model.q_dim + split_scores + gathered_kv + gate, shared


def _delta_saved(model: ModelShape, s: float, b: int, e: int) -> float:
    """A gated DeltaNet layer (Qwen3-Next's linear attention) as the CUDA kernels (causal-conv1d,
    fla's chunked rule) keep it, all split over TP by heads: the fused input projection's output
    (q, k, v, output gate, beta, decay), the convolution's output, fp32 decay and beta, the
    rule's fp32 in-chunk matrix (64 wide per value head) and its output, the gated norm's
    output (the output projection's input); plus the recurrent state at every chunk boundary
    (fp32 k_dim x v_dim per value head), which backward holds. Linear in s: no s x s term."""
    dn, sb = model.delta, s * b
    assert dn is not None
    heads, out = dn.v_heads, dn.v_heads * dn.v_dim
    saved = e * sb * (dn.in_features + dn.conv_channels + 2 * out)
    saved += 4 * sb * heads * (2 + DELTA_CHUNK)  # fp32 decay, beta, in-chunk matrix
    states = 4 * math.ceil(s / DELTA_CHUNK) * b * heads * dn.k_dim * dn.v_dim
    return saved + states


def _mlp_saved(model: ModelShape, ffn: int, tokens: float, e: int, fused: bool) -> float:
    """fc1 input, activation input (gate and up for gated MLPs), fc2 input; the unfused
    SwiGLU also keeps silu(gate) and its linear half (two more ffn-wide tensors)."""
    act_in = (2 if model.gated_mlp else 1) * ffn
    unfused = 2 * ffn if model.gated_mlp and not fused else 0
    return e * tokens * (model.hidden + act_in + unfused + ffn)


def dpo_fields(dpo: bool, precompute_reference: bool) -> dict[str, bool]:
    """``TrainShape``'s (and the planner's ``Workload``'s) DPO fields: pairs, and a reference
    model unless its log-probabilities are precomputed. One rule for ``mdtk estimate``,
    ``ds-config``, ``plan`` and the trainer's generator request."""
    if precompute_reference and not dpo:
        raise ConfigError("--precompute-reference applies to --dpo runs: add --dpo.")
    return {"pairs": dpo, "reference_model": dpo and not precompute_reference}


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
    eager = not train.flash_attention and cp == 1  # the CP attention always runs SDPA
    sb = train.seq_len / cp * train.rows
    sp_div = tp if sp else 1
    stored_layers = [layer_activations(model, train, i, cp=cp).total(tp, sp)
                     for i in params.layers]
    # the layer as backward rebuilds it (full) / the core attention alone (selective)
    rebuilt = [layer_activations(model, train, i, cp=cp, keep_core=eager).total(tp, sp)
               for i in params.layers]
    if train.recompute == "full":
        stored = len(stored_layers) * e * sb * model.hidden / sp_div  # each layer's input
        working = max(rebuilt, default=0.0)
    else:
        stored = sum(stored_layers)
        working = max((r - s for r, s in zip(rebuilt, stored_layers, strict=True)), default=0.0)
    if stage == 0 and train.dropout:
        stored += train.mask_bytes * sb * model.hidden / sp_div  # embedding dropout mask
    held = in_flight_microbatches(layout, stage, num_microbatches)
    out = {f"activations ({len(stored_layers)} layers x {held:g} micro-batches in flight)":
           stored * held}
    if model.lora and train.recompute != "full":  # each adapter's A x (r per token; the
        # projection's input is saved by A instead of by the frozen weight, which saves none)
        adapted = model.lora_projections(params.layers)
        out["LoRA adapter activations"] = adapted * model.lora_rank * e * sb * held
    if train.recompute != "none" and working:
        out["recompute working set (one layer)"] = working
    vocab = model.padded_vocab(tp) if tp > 1 else model.vocab
    if stage == layout.pp - 1:
        # final norm input [+ its normalised copy], output-layer input; the loss saves the fp32
        # softmax, and 16-bit training also holds the 16-bit logits while it is computed
        norm = 1 if train.fused or model.norm != "rms" else 2
        whole = (norm + 1) * e * sb * model.hidden
        logits = 4 + (e if train.dtype != "fp32" else 0)
        out["final norm, logits and loss"] = whole / sp_div + logits * sb * vocab / tp
        if train.grpo:  # its log-softmax: the fp32 exp and, kept by the gather, the fp32 result
            out[GRPO_LOSS_LINE] = 4 * sb * vocab / tp
    return out


def forward_saved_bytes(model: ModelShape, train: TrainShape, layout: ResolvedLayout) -> float:
    """What one forward of one micro-batch saves for backward on pipeline stage 0: the stored
    lines, not the recompute working set (it exists only during backward). The number that
    saved-tensor hooks measure, so tests and benchmarks compare against this one sum."""
    lines = activation_bytes(model, train, layout, rank_params(model, layout), stage=0,
                             num_microbatches=1)
    return sum(v for k, v in lines.items() if not k.startswith("recompute"))
