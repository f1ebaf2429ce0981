"""Rank functions for the context-parallel attention (toolkit.models.cp_attention).

The reference is full-sequence SDPA on every rank (same seeded inputs): the CP attention of this
rank's two chunks (megatron-core's layout, ``get_batch_on_this_cp_rank``) must give the reference
rows of the output, and after backward the rows of dq, dk and dv this rank owns.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _chunks(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """Chunks rank and 2cp-1-rank of 2cp along ``dim`` (megatron-core's CP layout)."""
    parts = x.chunk(2 * cp, dim=dim)
    return torch.cat([parts[rank], parts[2 * cp - 1 - rank]], dim=dim)


def attention_vs_reference(seq: int = 48, heads: int = 4, groups: int = 2, dim: int = 8,
                           batch: int = 2, padded: bool = False) -> dict[str, Any]:
    """Max abs errors of the CP attention (this world = the CP group) vs full SDPA."""
    from toolkit.models.cp_attention import cp_attention

    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, groups, seq, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, groups, seq, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64)
    scale = dim ** -0.5
    mask = None  # True = masked (megatron-core's sense)
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    if padded:  # right padding of different lengths per sample (padding keys masked out)
        pad = torch.zeros(batch, 1, seq, seq, dtype=torch.bool)
        for b in range(batch):
            pad[b, :, :, seq - 3 - 7 * b:] = True
        mask = pad
        allowed = allowed & ~pad
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    rq, rk, rv = ref_in
    ref = F.scaled_dot_product_attention(
        rq, rk.repeat_interleave(heads // groups, 1), rv.repeat_interleave(heads // groups, 1),
        attn_mask=allowed, scale=scale)
    (ref * dout).sum().backward()

    local = [_chunks(t, cp, rank, 2).clone().requires_grad_() for t in (q, k, v)]
    lmask = None if mask is None else _chunks(mask, cp, rank, 2)
    out = cp_attention(*local, group=group, scale=scale, mask=lmask)
    (out * _chunks(dout, cp, rank, 2)).sum().backward()
    errs = {"out": (out - _chunks(ref, cp, rank, 2)).abs().max().item()}
    for name, mine, full in zip("qkv", local, ref_in, strict=True):
        errs["d" + name] = (mine.grad - _chunks(full.grad, cp, rank, 2)).abs().max().item()
    errs["scale"] = max(ref.abs().max().item(), rq.grad.abs().max().item())
    dist.destroy_process_group(group)
    return errs


def attention_checks() -> dict[str, Any]:
    """Causal GQA, MHA, and padded GQA, in one pool call."""
    return {"gqa": attention_vs_reference(),
            "mha": attention_vs_reference(groups=4),
            "padded": attention_vs_reference(padded=True)}
