"""Context-parallel core attention without Transformer Engine: all-gather K/V, local SDPA.

megatron-core's local ``DotProductAttention`` asserts ``context_parallel_size == 1``; only
Transformer Engine's attention implements CP, and it needs CUDA and a matching build. This module
fills megatron-core's ``core_attention`` slot when cp > 1, on CPU (gloo) and GPU (NCCL) alike.

Layout (megatron-core's, so ``get_batch_on_this_cp_rank`` and its RoPE slicing apply): every
sequence is cut into 2*cp chunks; CP rank r holds chunks r and 2cp-1-r, which balances the causal
work. Each rank all-gathers K and V (its query-group heads only, before any GQA expansion) over the
CP group and computes its two query chunks exactly against the keys before them:

    chunk r        vs keys [0, (r+1)*c)        causal, bottom-right aligned
    chunk 2cp-1-r  vs keys [0, (2cp-r)*c)      causal, bottom-right aligned

On CUDA both are SDPA calls with ``causal_lower_right`` (the flash / memory-efficient kernels
take the lower-right mask natively). On CPU torch would materialise that c x prefix mask and keep
it for backward, so each chunk is its square causal block plus the unmasked prefix before it,
both through SDPA's CPU flash kernel and merged by log-sum-exp (:class:`_PrefixCausalAttention`):
memory linear in c. Every rank does (2cp+1)*c^2 score entries, the same on each rank. With an
explicit padding mask (``attention_mask`` [b, 1|heads, sq_local, s_full], True = masked, the
rows this rank's queries, as ``get_batch_on_this_cp_rank`` slices a full mask) or attention
dropout, both calls take a boolean mask instead (math / memory-efficient kernels, no flash).

Packed rows (``toolkit.models.packed.Segments``: examples kept apart): each query chunk is cut
at the example boundaries and each piece attends its own example's keys up to itself, the same
bottom-right causal block (``cp_attention_packed``).

Backward is exact: the gather's backward sums every rank's dK/dV of the gathered keys and hands
each owner its own rows (reduce-scatter on NCCL; all-reduce + slice on gloo, which lacks
``reduce_scatter``). Why all-gather and not a ring: see docs/training.md ("Context parallelism").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch.nn.attention.bias import causal_lower_right

from toolkit import rules
from toolkit.models.packed import Segments
from toolkit.parallel.layout import LayoutError


class CPUnsupported(LayoutError):
    """A model feature the context-parallel attention cannot compute exactly."""


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward sums the gradients and returns this
    rank's rows (the owner gets the dK/dV of its keys from every rank's queries)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        rows = grad.shape[0] // world
        if _is_gloo(group):  # gloo has no reduce_scatter: all-reduce, keep this rank's rows
            total = grad.clone()
            dist.all_reduce(total, group=group)
            return total.narrow(0, rank * rows, rows).contiguous(), None
        out = torch.empty((rows, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad, group=group)
        return out, None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` [2c, ...] (chunks r and 2cp-1-r of this rank) -> [2cp*c, ...] in sequence order."""
    cp = dist.get_world_size(group)
    gathered = _GatherSeq.apply(x, group)  # [cp ranks x (chunk r, chunk 2cp-1-r)]
    g = gathered.view(cp, 2, x.shape[0] // 2, *x.shape[1:])
    # ranks' first chunks are chunks 0..cp-1; their second chunks, in reverse rank order, cp..2cp-1
    return torch.cat([g[:, 0], g[:, 1].flip(0)], dim=0).reshape(cp * x.shape[0], *x.shape[1:])


def context_parallel_share(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This CP rank's chunks (r and 2cp-1-r of 2cp) of every [b, s] tensor of a batch (per-row
    [b] tensors, e.g. DPO's reference log-probabilities, are kept whole, and so are tensors
    named ``local_*``, already this rank's share: a teacher's logits computed under the same
    CP): megatron-core's layout, which its RoPE slicing and ``cp_attention`` expect. The
    trainer's micro-batches and the export's logits check cut their sequences here."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return batch
    from megatron.core.utils import get_batch_on_this_cp_rank

    tokens = {k: v for k, v in batch.items()
              if v is not None and v.dim() >= 2 and not k.startswith("local_")}
    seq = next(iter(tokens.values())).shape[1]
    if seq % (2 * cp):
        raise LayoutError(f"sequence length {seq} is not divisible by 2*cp = {2 * cp}: context "
                          "parallelism splits each sequence into 2*cp chunks.")
    return {**batch, **get_batch_on_this_cp_rank(tokens)}  # per-row values ([b]) stay whole


def cp_chunk_bounds(cp: int, rank: int, chunk: int) -> list[tuple[int, int]]:
    """(first query position, key prefix end) of this rank's two chunks of size ``chunk``."""
    return [(i * chunk, (i + 1) * chunk) for i in (rank, 2 * cp - 1 - rank)]


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of CPU flash attention: SDPA's own CPU kernel, which takes GQA
    heads and never builds the score matrix; the LSE lets two key blocks be merged exactly."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)


class _PrefixCausalAttention(torch.autograd.Function):
    """One query chunk of ``c`` rows against keys ``[0, end)``, its own block the last ``c``:
    no mask over the prefix ``[0, end - c)``, square causal over the block, merged by
    log-sum-exp. On CPU this replaces SDPA's lower-right causal mask, which torch materialises
    (c x end, kept for backward) off CUDA. Backward is exact: each block's flash backward with
    the merged output and LSE (the softmax over all keys) gives that block's share of dq and its
    dk, dv. Saved: q, k, v (views), the merged output and LSE; no c x end tensor."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        start = k.shape[2] - q.shape[2]
        out, lse = _flash_cpu(q, k[:, :, start:], v[:, :, start:], True, scale)
        if start:
            out_p, lse_p = _flash_cpu(q, k[:, :, :start], v[:, :, :start], False, scale)
            merged = torch.logaddexp(lse_p, lse)  # the LSE is fp32 (fp64 for fp64 inputs)
            out = (out_p.to(lse.dtype) * (lse_p - merged).exp().unsqueeze(-1)
                   + out.to(lse.dtype) * (lse - merged).exp().unsqueeze(-1)).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        start = k.shape[2] - q.shape[2]
        dout = dout.contiguous()
        blocks = [(start, k.shape[2], True)] + ([(0, start, False)] if start else [])
        dq, dks, dvs = None, [], []
        for lo, hi, causal in blocks:
            dq_b, dk_b, dv_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k[:, :, lo:hi], v[:, :, lo:hi], out, lse, 0.0, causal, scale=ctx.scale)
            dq = dq_b if dq is None else dq + dq_b
            dks.insert(0, dk_b)
            dvs.insert(0, dv_b)
        return dq, torch.cat(dks, dim=2), torch.cat(dvs, dim=2), None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, scale: float,
                 mask: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Exact causal attention of this rank's query chunks over the whole sequence.

    q [b, heads, 2c, d]; k, v [b, groups, 2c, d] (this rank's chunks; heads % groups == 0);
    mask: None or [b, 1|heads, 2c, 2cp*c] bool, True = may NOT attend (megatron-core's sense),
    key columns in sequence order. Returns [b, heads, 2c, d].
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[2] // 2
    # gather along the sequence (dim 0 of [s, b, g, d]) with the group heads only: less traffic
    k_full, v_full = (gather_sequence(t.permute(2, 0, 1, 3), group).permute(1, 2, 0, 3)
                      for t in (k, v))
    gqa = q.shape[1] != k.shape[1]
    blockwise = mask is None and dropout == 0.0 and q.device.type == "cpu"
    outs = []
    for half, (_, end) in enumerate(cp_chunk_bounds(cp, rank, c)):
        qh = q[:, :, half * c:(half + 1) * c]
        kh, vh = k_full[:, :, :end], v_full[:, :, :end]
        if blockwise:
            outs.append(_PrefixCausalAttention.apply(qh, kh, vh, scale))
            continue
        if mask is None:
            bias = causal_lower_right(c, end)
        else:
            causal = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(end - c)
            bias = causal & ~mask[:, :, half * c:(half + 1) * c, :end].bool()
        outs.append(F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale,
                                                   dropout_p=dropout, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def cp_attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                        *, group, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """:func:`cp_attention` for packed rows: each query chunk is cut at the example boundaries
    (``Segments.pieces``); a piece attends the keys of its own example up to itself, causal and
    bottom-right aligned (the same block as a whole chunk's, so the same kernels compute it)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = q.shape[2] // 2
    k_full, v_full = (gather_sequence(t.permute(2, 0, 1, 3), group).permute(1, 2, 0, 3)
                      for t in (k, v))
    rows = []
    for i in range(q.shape[0]):
        parts = []
        for half, (lo, hi) in enumerate(cp_chunk_bounds(cp, rank, c)):
            for q0, q1, k0 in segments.pieces(i, lo, hi):
                qh = q[i:i + 1, :, half * c + q0 - lo:half * c + q1 - lo]
                parts.append(_causal_block(qh, k_full[i:i + 1, :, k0:q1],
                                           v_full[i:i + 1, :, k0:q1], scale, dropout))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


def _causal_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  dropout: float) -> torch.Tensor:
    """Queries against keys ending at the queries' own positions (causal, bottom-right)."""
    if dropout == 0.0 and q.device.type == "cpu":
        return _PrefixCausalAttention.apply(q, k, v, scale)
    gqa = q.shape[1] != k.shape[1]
    lq, lk = q.shape[2], k.shape[2]
    if dropout == 0.0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk),
                                              scale=scale, enable_gqa=gqa)
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                          dropout_p=dropout, enable_gqa=gqa)


class CPAttention(MegatronModule):
    """megatron-core core attention for cp > 1 (the ``core_attention`` slot), any backend.

    Same constructor as megatron-core's ``DotProductAttention`` (heads per TP partition, softmax
    scale incl. query-key layer scaling, dropout). Refuses, at build time, what it cannot compute
    exactly: non-causal masks, sliding windows, learnable softmax offsets.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise CPUnsupported(f"context parallelism: attn_mask_type={attn_mask_type.name} "
                                "(only causal decoders are supported); set cp=1.")
        why = rules.cp_attention_problem(getattr(config, "window_size", None),
                                         getattr(config, "softmax_type", "vanilla"))
        if why:
            raise CPUnsupported(f"context parallelism: {why}; set cp=1.")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        tp = ps.get_tensor_model_parallel_world_size()
        projection = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection, tp)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        head_dim = divide(projection, config.num_attention_heads)
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= self.layer_number
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        segments = packed_seq_params if isinstance(packed_seq_params, Segments) else None
        if attention_bias is not None or (packed_seq_params is not None and segments is None):
            raise CPUnsupported("context parallelism with attention_bias or packed sequences "
                                "(thd) is not supported; set cp=1.")
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dv = v.shape[-1]  # MLA: v_head_dim < the q/k head size; the CPU flash kernel wants one
        if dv < q.shape[-1]:  # size: zero columns of v add nothing and are cut off after
            v = F.pad(v, (0, q.shape[-1] - dv))
        dropout = self.attention_dropout.p if self.training else 0.0
        rng = (tensor_parallel.get_cuda_rng_tracker().fork()
               if dropout > 0 and not self.config.sequence_parallel else contextlib.nullcontext())
        with rng:
            group = ps.get_context_parallel_group()
            if segments is not None:
                context = cp_attention_packed(q, k, v, segments, group=group,
                                              scale=self.softmax_scale, dropout=dropout)
            else:
                context = cp_attention(q, k, v, group=group, scale=self.softmax_scale,
                                       mask=attention_mask, dropout=dropout)
        context = context[..., :dv].permute(2, 0, 1, 3).contiguous()  # [s, b, heads, d]
        return context.view(*context.shape[:2], self.hidden_size_per_partition)


def with_cp_attention(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a transformer layer) with :class:`CPAttention` in the core-attention slot
    (multi-latent attention's: taking its ``k_channels`` / ``v_channels``)."""
    from toolkit.models.attention import latent_variant

    layer = spec.submodules
    attn = layer.self_attention
    latent = hasattr(attn.submodules, "linear_kv_down_proj")
    core = latent_variant(CPAttention) if latent else CPAttention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=core)
    layer = dataclasses.replace(layer, self_attention=dataclasses.replace(attn,
                                                                           submodules=attn_sub))
    return dataclasses.replace(spec, submodules=layer)
