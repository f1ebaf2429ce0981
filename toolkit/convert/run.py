"""``convert``: any supported checkpoint format to any other, at any target layout.

The source is any format of the registry (``toolkit.checkpoint.formats``), opened as HF-named
tensors (``sources``). Writers pull exactly the regions each output tensor needs, through the
adapter's mapping table and ``plan_rank``, so one output tensor (or one legacy rank file) is in
memory at a time and nothing depends on a process group or a GPU. Outputs are written into a
temporary sibling folder and renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.checkpoint import CheckpointError, hf, mcore_dist, megatron_legacy
from toolkit.checkpoint.torchfree import dtypes
from toolkit.convert.hf_target import write_hf
from toolkit.convert.megatron_targets import write_megatron
from toolkit.convert.pool import sharing
from toolkit.convert.progress import Progress
from toolkit.convert.readback import verify_conversion
from toolkit.convert.sources import Ctx, detect, open_ctx
from toolkit.lazy import torch
from toolkit.parallel.layout import ParallelLayout

#: Output formats, named as the registry's formats (the result is read back as one).
TARGETS = (hf.FORMAT, mcore_dist.FORMAT, megatron_legacy.FORMAT)
DTYPES = dtypes.PRECISIONS


@dataclass
class Report:
    src: Path
    dst: Path
    source_format: str
    target: str
    layout: ParallelLayout
    tensors: int
    bytes: int
    seconds: float
    files: list[str] = field(default_factory=list)
    verify: bool = False  # --verify: the result was read back
    verified: int = 0  # tensors read back from dst and compared bit-exactly (--verify)

    def summary(self) -> list[str]:
        """What ``mdtk convert`` prints: the conversion, and the read-back when verified."""
        lay = "" if self.target == hf.FORMAT else (
            f" tp={self.layout.tp} pp={self.layout.pp}"
            + (f" vpp={self.layout.vpp}" if self.layout.vpp else "")
            + (f" ep={self.layout.ep}" if self.layout.ep > 1 else ""))
        lines = [f"{self.source_format} -> {self.target}{lay}: {self.tensors} tensors, "
                 f"{self.bytes / 2**20:.1f} MiB, {len(self.files)} files in "
                 f"{self.seconds:.1f} s -> {self.dst}"]
        if self.verify:
            lines.append(f"verified: {self.verified} tensors read back bit-exactly equal")
        return lines


def resolve_workers(workers: int | str) -> int:
    """Worker processes for ``--workers``: a number >= 1, or ``auto``: one per two cores (each
    worker keeps two cores busy, reading the next tensor in a thread while it writes the current
    one), at least one; on this 2-core machine one process, both cores."""
    if workers == "auto":
        return max(1, (os.cpu_count() or 1) // 2)
    try:
        n = int(workers)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ValueError(f"--workers {workers}: give a number >= 1 or 'auto'.")
    return n


def convert(
    src: str | Path,
    dst: str | Path,
    to: str,
    layout: ParallelLayout | None = None,
    dtype: torch.dtype | str | None = None,
    workers: int | str = "auto",
    overwrite: bool = False,
    progress: bool = True,
    *,
    source_format: str | None = None,
    hf_config: str | Path | None = None,
    vocab_multiple: int = 128,
    verify: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    fsync: bool = False,
) -> Report:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst`` (layout for Megatron).

    ``layout``: tp/pp/vpp/ep of a megatron-legacy target (one file per rank); for mcore only
    tp matters (vocab padding: ``vocab_multiple * tp``, by default Megatron-LM's 128 x tp);
    ignored for hf. ``dtype`` casts
    floating tensors (default: keep each tensor's dtype). ``verify`` reads every tensor of the
    result back and compares it bit-exactly with the source. ``fsync``: flush every output file
    to disk before the rename (durable against power loss; off by default, as ``cp`` and
    ``torch.save`` do).
    """
    start = time.perf_counter()
    if to not in TARGETS:
        raise ValueError(f"--to {to!r}: choose one of {', '.join(TARGETS)}.")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}.")
        dtype = DTYPES[dtype]
    elif dtype is not None:
        dtype = dtypes.of(dtype)  # a torch dtype: by name from here on
    workers = resolve_workers(workers)
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if dst == src or src in dst.parents:
        raise ValueError(f"destination {dst} is inside the source {src}: choose another folder.")
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} exists: choose a new folder or pass --overwrite.")
    layout = layout or ParallelLayout()
    fmt = source_format or detect(src)
    ctx = Ctx(fmt, str(src), str(hf_config) if hf_config else None, dtype, vocab_multiple)
    op = open_ctx(ctx)
    ctx = dataclasses.replace(ctx, spec=op.spec)  # workers, read-back: the model as read here
    try:
        adapter = op.adapter
        adapter.validate(layout)
        if to == "megatron-legacy" and layout.etp not in (None, layout.tp):
            raise ValueError(f"--etp {layout.etp}: the legacy format supports expert-TP equal "
                             f"to tp ({layout.tp}) only.")
        dtype_of = op.dtype_of(dtype)
        expected = adapter.expected_tensors()
        total = sum(math.prod(s) * dtype_of(n).itemsize for n, s in expected.items())
        with Progress(progress, total, f"{fmt} -> {to}") as bar, sharing(op):
            if to == "hf":
                write_hf(op, dst, dtype, bar, overwrite=overwrite,
                         max_shard_bytes=max_shard_bytes, fsync=fsync)
            else:
                write_megatron(ctx, op, to, dst, layout, dtype, workers, overwrite, bar, fsync)
    finally:
        op.source.close()
    report = Report(src, dst, fmt, to, layout, len(expected), total,
                    0.0, sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()))
    if verify:
        report.verify = True
        report.verified = verify_conversion(ctx, dst, to, dtype)
    report.seconds = time.perf_counter() - start
    return report
