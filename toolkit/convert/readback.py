"""``--verify``: every tensor of a finished conversion read back and compared bit-exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.convert.sources import Ctx, full, open_checkpoint, open_ctx
from toolkit.lazy import torch


def verify_conversion(ctx: Ctx, dst: Path, to: str, dtype: torch.dtype | None) -> int:
    """Read every HF tensor of ``dst`` (format ``to``: targets are named as their formats) and
    compare bit-exactly with the source (cast to dtype); returns how many tensors were compared,
    raises CheckpointError naming those that differ. A Megatron result is read through the
    source's model (``ctx.spec``: its config.json is the one written from it); an HF folder as
    any HF folder, from its own config.json (part of what is verified)."""
    a = open_ctx(ctx)
    try:
        if to == "hf":
            b = open_checkpoint(dst, fmt=to)
        else:
            b = open_ctx(dataclasses.replace(ctx, fmt=to, src=str(dst)))
    except BaseException:
        a.source.close()
        raise
    try:
        bad, n = [], 0
        for name, shape in a.adapter.expected_tensors().items():
            x = a.read(name, full(shape))
            if dtype is not None and x.is_floating_point():
                x = x.to(to_torch(dtype))
            y = b.read(name, full(shape))
            n += 1
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                bad.append(name)
        if bad:
            raise CheckpointError(f"verification failed: {len(bad)} tensor(s) of {dst} differ "
                                  f"from the source: {', '.join(bad[:8])}.")
        return n
    finally:
        a.source.close()
        b.source.close()
