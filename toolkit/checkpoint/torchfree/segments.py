"""Byte ranges of files, ``(file, offset, length)``: how a conversion names the source bytes of an
output tensor it copies file to file (``torch_record`` into torch_dist records, ``hf`` into
safetensors shards), and the operations on them, in one place."""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError

#: ``(file, offset, length)``: ``length`` bytes of ``file`` from ``offset``; file None = zeros.
Segment = tuple["Path | str | None", int, int]
_ZEROS = 1 << 20
_CHUNK = 64 * 2**20


def copy_range(src_fd: int, offset: int, n: int, dst_fd: int) -> None:
    """Append ``n`` bytes of ``src_fd`` from ``offset`` at ``dst_fd``'s position: in the kernel
    (``copy_file_range``, what ``cp`` does: no copy through user memory) where the system
    allows, else with 64 MiB positioned reads and writes."""
    done = 0
    fast = hasattr(os, "copy_file_range")
    while done < n:
        if fast:
            try:
                got = os.copy_file_range(src_fd, dst_fd, n - done, offset + done)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL,
                                     errno.EBADF):
                    raise
                fast = False
                continue
        else:
            chunk = os.pread(src_fd, min(_CHUNK, n - done), offset + done)
            got = len(chunk)
            write_all(dst_fd, chunk)
        if not got:
            raise CheckpointError(f"unexpected end of file copying {n} bytes from byte "
                                  f"{offset} (truncated source).")
        done += got


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def copy_segments(segments: Iterable[Segment], fd: int) -> None:
    """Append the bytes of ``segments`` at ``fd``'s position."""
    for file, offset, n in segments:
        if file is None:
            while n > 0:
                n -= os.write(fd, bytes(min(n, _ZEROS)))
            continue
        with open(file, "rb", buffering=0) as src:
            copy_range(src.fileno(), offset, n, fd)


def crc32(segments: Iterable[Segment]) -> int:
    """The zip CRC32 of the bytes of ``segments`` (read once)."""
    crc = 0
    for file, offset, n in segments:
        if file is None:
            while n > 0:
                crc = zlib.crc32(bytes(min(n, _ZEROS)), crc)
                n -= _ZEROS
            continue
        with open(file, "rb", buffering=0) as src:
            for at in range(offset, offset + n, _CHUNK):
                crc = zlib.crc32(os.pread(src.fileno(), min(_CHUNK, offset + n - at), at), crc)
    return crc


def merge(segments: Iterable[Segment]) -> list[Segment]:
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


def will_need(segments: Iterable[Segment]) -> None:
    """Ask the kernel to start reading these ``(file, offset, length)`` ranges now
    (``POSIX_FADV_WILLNEED``; a hint, no data moves through this process).

    Why: a conversion's reads follow the output's order, not the source file's (mcore -> HF cuts
    q, k and v out of each layer's fused QKV), so the kernel's own read-ahead, which follows
    sequential reads, misses; hinting the next tensor's ranges from the read-ahead thread makes
    the disk read them while the current tensor is copied. Pages already cached cost nothing.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    by_file: dict[Any, list[tuple[int, int]]] = {}
    for file, offset, n in segments:
        if file is not None and n > 0:
            by_file.setdefault(file, []).append((offset, n))
    for file, ranges in by_file.items():
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue  # a hint only: the copy reports a missing file
        try:
            for offset, n in ranges:
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
