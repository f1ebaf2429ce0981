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


def _fwd_bwd_ms(module, q, k, v, dout, repeats: int) -> float:
    """Median milliseconds of one forward + backward of a core attention ([s, b, heads, d])."""
    import statistics
    import time

    times = []
    for _ in range(repeats + 1):  # the first call warms kernels and allocators up
        if q.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        module(q, k, v, None).backward(dout)
        if q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def core_attention_vs_megatron(seq: int, heads: int = 8, groups: int = 2, dim: int = 64,
                               dtype: str = "fp32", repeats: int = 3) -> dict[str, Any]:
    """The CP core attention (a one-rank CP group: chunks 0 and 1 of the sequence) against
    megatron-core's local ``DotProductAttention`` and mdtk's ``SDPAttention`` on this rank's
    device, causal GQA: max abs difference of the output and of dq, dk, dv from the local path,
    and the median forward + backward milliseconds of each. What the issue asks on a GPU: the
    CP attention's kernel time at cp1 against megatron-core's path."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from toolkit import parallel, runtime
    from toolkit.models import transformer_config
    from toolkit.models.attention import SDPAttention
    from toolkit.models.cp_attention import CPAttention
    from toolkit.parallel import ParallelLayout

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    parallel.initialize(ParallelLayout())
    try:
        config = transformer_config(
            num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
            num_query_groups=groups, attention_dropout=0.0, params_dtype=torch_dtype,
            bf16=dtype == "bf16")
        modules = {cls.__name__: cls(config, 1, AttnMaskType.causal, "self")
                   for cls in (DotProductAttention, SDPAttention, CPAttention)}
        g = torch.Generator().manual_seed(11)
        dev = runtime.device()

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(dev, torch_dtype)

        q, k, v = rand(seq, 1, heads, dim), rand(seq, 1, groups, dim), rand(seq, 1, groups, dim)
        dout = rand(seq, 1, heads * dim)
        # CPAttention takes megatron-core's CP layout: at cp=1, chunk 0 then chunk 1, as is
        grads = {}
        for name, module in modules.items():
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = module(*inputs, None)
            out.backward(dout)
            grads[name] = [out.detach().float()] + [t.grad.float() for t in inputs]
        ref = grads["DotProductAttention"]
        result: dict[str, Any] = {"scale": max(t.abs().max().item() for t in ref)}
        for name in ("SDPAttention", "CPAttention"):
            result[name] = {part: (a - b).abs().max().item()
                            for part, a, b in zip(("out", "dq", "dk", "dv"), grads[name], ref,
                                                  strict=True)}
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        result["ms"] = {name: _fwd_bwd_ms(module, *leaves, dout, repeats)
                        for name, module in modules.items()}
        result["device"] = str(dev)
        return result
    finally:
        parallel.destroy()
