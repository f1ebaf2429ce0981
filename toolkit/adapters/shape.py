"""A transformer's shape, as its model family describes it, and its exact list of parameter tensors.

The shape is part of the model description (``toolkit.adapters.spec.ModelSpec.shape``); the memory
model, the planner and the trainer's FLOP count read it. It comes from the family's ``Dims``, the
same description the adapter loads weights with, so a family file that declares a new family
gets correct estimates; nothing here branches on the architecture. Parameter counts are derived
from the list of tensors (not from a closed formula) so that per-rank counts under
tensor/pipeline/expert parallelism and ZeRO-3's persistence threshold are computed from the same
source of truth. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from toolkit.adapters.family import Dims
from toolkit.adapters.hybrid import DeltaDims
from toolkit.mapping import padded_vocab_size

# How a tensor is split across ranks (megatron-core convention).
COL, ROW, REP, VOCAB, EXPERT = "col", "row", "rep", "vocab", "expert"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    numel: int
    split: str  # COL / ROW / REP / VOCAB / EXPERT
    layer: int | None  # decoder layer index, None for embedding / final norm / head
    trainable: bool = True  # False: a frozen base weight under LoRA (no gradient, no optimizer)


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer (built from a family's ``Dims``: ``from_dims``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    gated_mlp: bool = True
    norm: str = "rms"  # "rms" (weight only) or "layer" (weight + bias)
    qk_norm: bool = False
    post_norms: bool = False  # norms after the attention and MLP outputs too (Gemma)
    learned_positions: int = 0  # rows of a learned position embedding (GPT-2), 0 for RoPE
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    shared_gate: bool = False
    router_bias: bool = False  # per-expert score-correction bias (a buffer, stored with weights)
    moe_layers: tuple[int, ...] = ()
    # Multi-latent attention (DeepSeek; kv_lora 0: GQA): latent sizes, per-head q/k sizes
    # without / with RoPE; head_dim is then the value head size.
    kv_lora: int = 0
    q_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    sinks: bool = False  # a learned logit per head in every softmax (GPT-OSS)
    attn_gate: bool = False  # q_proj also holds a per-head output gate (Qwen3-Next)
    delta: DeltaDims | None = None  # gated DeltaNet sizes (hybrid models) and its layers
    delta_layers: tuple[int, ...] = ()
    cp_refusal: str = ""  # why context parallelism cannot run it ("" when it can)
    name: str = "model"
    #: The adapter's vocab padding: megatron-core's vocab is a multiple of ``vocab_multiple * tp``
    #: (``toolkit.mapping.padded_vocab_size``; 1 = the adapter's default, the least padding).
    vocab_multiple: int = 1
    #: LoRA / DoRA adapter tensors (``with_lora``); when present the base weights are frozen.
    lora: tuple[TensorSpec, ...] = ()
    lora_rank: int = 0

    @classmethod
    def from_dims(cls, d: Dims, name: str = "model") -> ModelShape:
        return cls(
            hidden=d.hidden, layers=d.layers, heads=d.heads, kv_heads=d.groups,
            head_dim=d.head_dim, ffn=d.dense_ffn or d.ffn, vocab=d.vocab, tied=d.tied,
            qkv_bias=d.qkv_bias, o_bias=d.linear_bias, mlp_bias=d.linear_bias, gated_mlp=d.gated,
            norm="layer" if d.norm == "LayerNorm" else "rms", qk_norm=d.qk_norm,
            post_norms=d.post_norms, learned_positions=d.positions, experts=d.experts,
            top_k=d.top_k,
            moe_ffn=d.ffn if d.experts else 0, shared_ffn=d.shared_ffn, shared_gate=d.shared_gate,
            router_bias=d.router_bias, moe_layers=d.moe_layers, kv_lora=d.kv_lora,
            q_lora=d.q_lora, qk_nope=d.qk_nope, qk_rope=d.qk_rope, sinks=d.sinks,
            attn_gate=d.attn_gate, delta=d.delta, delta_layers=d.delta_layers, name=name,
        )

    # -- derived -----------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the queries (MLA: per head, the q/k size with the RoPE part)."""
        return self.heads * (self.qk_nope + self.qk_rope if self.kv_lora else self.head_dim)

    @property
    def kv_dim(self) -> int:
        """Width of the keys (MLA: expanded from the latent per head, as attention sees them)."""
        return self.q_dim if self.kv_lora else self.kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary megatron-core holds: padded as the adapter pads it."""
        return padded_vocab_size(self.vocab, tp, self.vocab_multiple)

    def tensors(self, *, vocab: int | None = None) -> Iterator[TensorSpec]:
        """Every parameter tensor of the HF model, with how megatron-core splits it (with LoRA:
        the frozen base tensors, then the adapters)."""
        if not self.lora:
            yield from self._base_tensors(vocab)
            return
        for t in self._base_tensors(vocab):
            yield dataclasses.replace(t, trainable=False)
        yield from self.lora

    def _base_tensors(self, vocab: int | None) -> Iterator[TensorSpec]:
        h, v = self.hidden, vocab or self.vocab
        norm_n = 2 if self.norm == "layer" else 1
        yield TensorSpec("embed", v * h, VOCAB, None)
        if self.learned_positions:
            yield TensorSpec("pos_embed", self.learned_positions * h, REP, None)
        for i in range(self.layers):
            yield from self._layer_tensors(i, norm_n)
        yield TensorSpec("final_norm", norm_n * h, REP, None)
        if not self.tied:
            yield TensorSpec("lm_head", v * h, VOCAB, None)

    def _layer_tensors(self, i: int, norm_n: int) -> Iterator[TensorSpec]:
        h = self.hidden
        for k in range(norm_n):
            yield TensorSpec(f"l{i}.input_norm.{k}", h, REP, i)
        if i in self.delta_layers:
            yield from self._delta_tensors(i)
        else:
            yield from (self._mla_tensors(i) if self.kv_lora else self._gqa_tensors(i))
        for k in range(norm_n):
            yield TensorSpec(f"l{i}.post_norm.{k}", h, REP, i)
        if self.post_norms:
            for k in range(norm_n):
                yield TensorSpec(f"l{i}.attn_out_norm.{k}", h, REP, i)
                yield TensorSpec(f"l{i}.mlp_out_norm.{k}", h, REP, i)
        if self.is_moe_layer(i):
            yield TensorSpec(f"l{i}.router", self.experts * h, REP, i)
            if self.router_bias:
                yield TensorSpec(f"l{i}.router_bias", self.experts, REP, i)
            yield TensorSpec(f"l{i}.experts", self.experts * self._mlp_numel(self.moe_ffn),
                             EXPERT, i)
            if self.shared_ffn:
                yield from self._mlp_tensors(f"l{i}.shared", self.shared_ffn, i)
            if self.shared_gate:
                yield TensorSpec(f"l{i}.shared_gate", h, REP, i)
        else:
            yield from self._mlp_tensors(f"l{i}.mlp", self.ffn, i)

    def _gqa_tensors(self, i: int) -> Iterator[TensorSpec]:
        h = self.hidden
        yield TensorSpec(f"l{i}.q", h * self.q_dim * (2 if self.attn_gate else 1), COL, i)
        yield TensorSpec(f"l{i}.k", h * self.kv_dim, COL, i)
        yield TensorSpec(f"l{i}.v", h * self.kv_dim, COL, i)
        if self.qkv_bias:
            yield TensorSpec(f"l{i}.qkv_bias", self.q_dim + 2 * self.kv_dim, COL, i)
        yield TensorSpec(f"l{i}.o", self.q_dim * h, ROW, i)
        if self.o_bias:
            yield TensorSpec(f"l{i}.o_bias", h, REP, i)
        if self.qk_norm:
            yield TensorSpec(f"l{i}.q_norm", self.head_dim, REP, i)
            yield TensorSpec(f"l{i}.k_norm", self.head_dim, REP, i)
        if self.sinks:
            yield TensorSpec(f"l{i}.sinks", self.heads, COL, i)

    def _delta_tensors(self, i: int) -> Iterator[TensorSpec]:
        """Qwen3-Next's gated DeltaNet: fused input projection, depthwise causal convolution,
        per-value-head decay parameters (split over TP), output norm, output projection."""
        dn, h = self.delta, self.hidden
        assert dn is not None
        yield TensorSpec(f"l{i}.in_proj", h * dn.in_features, COL, i)
        yield TensorSpec(f"l{i}.conv", dn.conv_channels * dn.kernel, COL, i)
        yield TensorSpec(f"l{i}.dt_bias", dn.v_heads, COL, i)
        yield TensorSpec(f"l{i}.A_log", dn.v_heads, COL, i)
        yield TensorSpec(f"l{i}.out_norm", dn.v_dim, REP, i)
        yield TensorSpec(f"l{i}.out_proj", dn.v_heads * dn.v_dim * h, ROW, i)

    def _mla_tensors(self, i: int) -> Iterator[TensorSpec]:
        """DeepSeek's attention: down projections (column-parallel in megatron-core), latent
        norms, per-head up projections, output projection."""
        h, n, v = self.hidden, self.heads, self.head_dim
        if self.q_lora:
            yield TensorSpec(f"l{i}.q_down", h * self.q_lora, COL, i)
            yield TensorSpec(f"l{i}.q_norm", self.q_lora, REP, i)
            yield TensorSpec(f"l{i}.q_up", self.q_lora * self.q_dim, COL, i)
        else:
            yield TensorSpec(f"l{i}.q", h * self.q_dim, COL, i)
        yield TensorSpec(f"l{i}.kv_down", h * (self.kv_lora + self.qk_rope), COL, i)
        yield TensorSpec(f"l{i}.kv_norm", self.kv_lora, REP, i)
        yield TensorSpec(f"l{i}.kv_up", self.kv_lora * n * (self.qk_nope + v), COL, i)
        yield TensorSpec(f"l{i}.o", n * v * h, ROW, i)

    def _mlp_numel(self, ffn: int) -> int:
        """An MLP's elements (an expert's: the model's MLP biases included)."""
        n_in = 2 if self.gated_mlp else 1
        bias = n_in * ffn + self.hidden if self.mlp_bias else 0
        return (n_in + 1) * self.hidden * ffn + bias

    def _mlp_tensors(self, prefix: str, ffn: int, i: int) -> Iterator[TensorSpec]:
        h = self.hidden
        n_in = 2 if self.gated_mlp else 1
        yield TensorSpec(f"{prefix}.fc1", n_in * h * ffn, COL, i)
        yield TensorSpec(f"{prefix}.fc2", ffn * h, ROW, i)
        if self.mlp_bias:
            yield TensorSpec(f"{prefix}.fc1_bias", n_in * ffn, COL, i)
            yield TensorSpec(f"{prefix}.fc2_bias", h, REP, i)

    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors())

    def trainable_params(self) -> int:
        """Parameters with gradients and optimizer states (all, or the LoRA adapters)."""
        return sum(t.numel for t in self.tensors() if t.trainable)

    def with_lora(self, adapters: Iterator[tuple[int, int, int]], rank: int) -> ModelShape:
        """This shape with rank-``rank`` LoRA adapters, given as (layer, TP-sharded, replicated)
        element counts per adapted projection (``toolkit.lora.targets.Projection.numel``)."""
        specs = []
        for i, (layer, sharded, replicated) in enumerate(adapters):
            specs += [TensorSpec(f"l{layer}.lora{i}.sharded", sharded, COL, layer),
                      TensorSpec(f"l{layer}.lora{i}.replicated", replicated, REP, layer)]
        return dataclasses.replace(self, lora=tuple(specs), lora_rank=rank)

    def lora_projections(self, layers: Iterator[int] | set[int]) -> int:
        """Adapted projections in ``layers`` (each holds an ``[r]`` activation per token)."""
        wanted = set(layers)
        return sum(1 for t in self.lora if t.layer in wanted and t.name.endswith(".sharded"))

    def active_params(self) -> int:
        """Parameters one token passes through (MoE: top-k of the experts)."""
        total = 0
        for t in self.tensors():
            total += t.numel * self.top_k // self.experts if t.split == EXPERT else t.numel
        return total

    def layer_params(self, layer: int) -> int:
        return sum(t.numel for t in self._layer_tensors(layer, 2 if self.norm == "layer" else 1))
