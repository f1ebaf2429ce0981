"""A ``torch.save`` record of one tensor whose bytes are copied file to file, never through memory.

A torch_dist data file (``__R_I.distcp``) is a sequence of ``torch.save``d tensors. When an
output tensor is a list of byte ranges of source files (whole rows of row-major tensors in the
same dtype: a layer's tensor, ``[gate; up]``, fused QKV, a vocab slice), ``save_segments`` lets
``torch.save`` write the record's framing itself (zip headers, pickle, alignment, central
directory: byte for byte what ``torch.save`` writes) under ``torch.serialization.skip_data``,
where ``torch.save`` *seeks* over the tensor's data instead of writing it; that one seek is
turned into ``copy_file_range`` copies of the ranges (``hf.copy_range``: in the kernel, as
``cp`` does, ``pread``/``write`` where the system refuses it). The placeholder tensor handed to
``torch.save`` is ``torch.empty`` (never touched, so never faulted in): no tensor byte passes
through user memory. As with any ``skip_data`` save, the zip CRC of the data entry is 0 (torch's
reader does not check CRCs; ``set_crc32_options(False)`` writes 0 for every entry).
"""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.dtypes import torch
from toolkit.checkpoint.hf import copy_range

#: ``(file, offset, length)``: ``length`` bytes of ``file`` from ``offset``; file None = zeros.
Segment = tuple["Path | str | None", int, int]
_ZEROS = 1 << 20


class _Sink:
    """The file-like ``torch.save`` writes to: writes go to ``fd``; the one data seek of a
    ``skip_data`` save becomes the copies of ``segments``."""

    def __init__(self, fd: int, segments: list[Segment], nbytes: int):
        self.fd, self.segments, self.nbytes, self.copied = fd, segments, nbytes, False

    def write(self, data: object) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        n = len(view)
        while view:
            view = view[os.write(self.fd, view):]
        return n

    def seek(self, n: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR or n != self.nbytes or self.copied:
            raise CheckpointError(f"torch.save under skip_data seeked ({n}, {whence}) where one "
                                  f"data seek of {self.nbytes} bytes was expected: this torch "
                                  "version writes records differently; convert with --dtype "
                                  "or report it.")
        _copy(self.segments, self.fd)
        self.copied = True
        return os.lseek(self.fd, 0, os.SEEK_CUR)

    def tell(self) -> int:
        return os.lseek(self.fd, 0, os.SEEK_CUR)

    def flush(self) -> None:
        pass


def _copy(segments: list[Segment], fd: int) -> None:
    """Append the bytes of ``segments`` at ``fd``'s position."""
    for file, offset, n in segments:
        if file is None:
            while n > 0:
                n -= os.write(fd, bytes(min(n, _ZEROS)))
            continue
        with open(file, "rb", buffering=0) as src:
            copy_range(src.fileno(), offset, n, fd)


def save_segments(fd: int, shape: tuple[int, ...], dtype: torch.dtype,
                  segments: list[Segment]) -> int:
    """Write at ``fd``'s position the ``torch.save`` record of a contiguous ``shape`` /
    ``dtype`` tensor whose bytes are ``segments`` in order; returns the record's length."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    have = sum(n for _, _, n in segments)
    if have != nbytes:
        raise CheckpointError(f"segments hold {have} bytes, a {tuple(shape)} {dtype} tensor "
                              f"needs {nbytes}.")
    start = os.lseek(fd, 0, os.SEEK_CUR)
    sink = _Sink(fd, segments, nbytes)
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=getattr(dtype, "torch", dtype)), sink)  # type: ignore[arg-type]
    if nbytes and not sink.copied:
        raise CheckpointError("torch.save under skip_data wrote no data seek: this torch "
                              "version writes records differently.")
    return os.lseek(fd, 0, os.SEEK_CUR) - start


def merge(segments: list[Segment]) -> list[Segment]:
    """Adjacent ranges of the same file (or adjacent zero runs) joined into one."""
    out: list[Segment] = []
    for seg in segments:
        if seg[2] == 0:
            continue
        if out and out[-1][0] == seg[0] and (seg[0] is None or out[-1][1] + out[-1][2] == seg[1]):
            last = out[-1]
            out[-1] = (last[0], last[1], last[2] + seg[2])
        else:
            out.append(seg)
    return out
