"""Rank functions of tests/test_gpu_kernels.py: a model with mdtk's fused CUDA kernels
(``toolkit.models.kernels``) against the same model unfused, loss and every gradient."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dist_checks import adapter_checks as ac

SETS = {  # kernels checked together against the unfused model, in this dtype
    "swiglu+linear_cross_entropy": (dict(swiglu=True, linear_cross_entropy=True), "fp32"),
    # megatron-core's fused CE rounds the logits' gradient to bf16: for bf16 runs only
    "swiglu+cross_entropy": (dict(swiglu=True, cross_entropy=True), "bf16"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _loss_and_grads(root: Path, family: str, kernels: Any, dtype: str, tokens: torch.Tensor,
                    labels: torch.Tensor, mask: torch.Tensor) -> tuple[float, dict]:
    """The masked token-loss sum of ``family`` built with ``kernels`` on this GPU, and the
    gradient of every parameter (fp32, TF32 off)."""
    from toolkit import parallel
    from toolkit.adapters import adapter_for
    from toolkit.adapters.live import build_model, fill_chunks
    from toolkit.checkpoint.hf import HFReader
    from toolkit.parallel import ParallelLayout

    mpu = parallel.initialize(ParallelLayout())
    try:
        adapter = adapter_for(root / family, dtype=DTYPES[dtype])
        with HFReader(root / family) as reader:
            (chunk,) = build_model(adapter, mpu.layout, kernels=kernels)
            fill_chunks([chunk], adapter, reader)
        chunk = chunk.cuda()
        if kernels.linear_cross_entropy:
            chunk.linear_ce_vocab = adapter.dims.vocab
        pos = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
        out = chunk(tokens, pos, None, labels=labels, loss_mask=mask)
        loss = out.float() if out.dim() == 0 else (out.float() * mask).sum()
        loss.backward()
        grads = {n: p.grad.detach().float() for n, p in chunk.named_parameters()}
        return loss.item(), grads
    finally:
        parallel.destroy()


def _rel(grads: dict, ref: dict) -> float:
    """The worst gradient difference, relative to each gradient's largest entry."""
    return max(((grads[n] - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
               for n, r in ref.items())


def check_fused_kernels(root: str, families: list[str]) -> dict[str, dict[str, Any]]:
    """Per family and kernel set, against the fp32 model without fused kernels: the loss's and
    the worst gradient's relative difference, and (bf16 sets) the same for the bf16 model
    without fused kernels, the error the fused one must not exceed by much."""
    from toolkit.models.kernels import Kernels

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(3)
    tokens = ac.tokens().cuda()
    labels = torch.roll(tokens, -1, dims=1)
    mask = (torch.rand(tokens.shape, generator=g) > 0.3).float().cuda()
    out: dict[str, dict[str, Any]] = {}
    for family in families:
        runs = {d: _loss_and_grads(Path(root), family, Kernels(), d, tokens, labels, mask)
                for d in DTYPES}
        ref_loss, ref = runs["fp32"]
        for name, (chosen, dtype) in SETS.items():
            loss, grads = _loss_and_grads(Path(root), family, Kernels(**chosen), dtype, tokens,
                                          labels, mask)
            plain_loss, plain = runs[dtype]
            out[f"{family}:{name}"] = {
                "dtype": dtype, "params": len(grads) == len(ref),
                "loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": _rel(grads, ref),
                "unfused_loss_rel": abs(plain_loss - ref_loss) / abs(ref_loss),
                "unfused_grad_rel": _rel(plain, ref)}
    return out
