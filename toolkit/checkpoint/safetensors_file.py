"""One ``.safetensors`` file read with positioned reads: only the bytes of a region, no memory map.

The reader of HF checkpoints (``hf.HFReader``) opens each shard with ``SafetensorsFile``; a
region's byte range (``byte_range``) is what a conversion copies file to file.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.torchfree import dtypes
from toolkit.lazy import torch

#: The fix for a damaged file (no reader can tell what its bytes should have been).
AGAIN = "copy or download the file again"


def _count(x: object) -> int:
    """A size or offset from the header: a non-negative JSON integer."""
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(f"{x!r} is not a non-negative integer")
    return x


class SafetensorsFile:
    """One ``.safetensors`` file read with plain positioned reads (no memory map).

    The header (8-byte little-endian length + JSON) is parsed and checked when opening: every
    tensor's byte range must match its shape and dtype and lie inside the file, so a truncated
    file fails here, naming itself. ``read`` copies only the bytes of the rows a region spans
    (in blocks of at most ``block_bytes`` when the region also cuts the inner dimensions), so
    memory holds the result plus one block, and no file pages stay mapped into the process.
    """

    block_bytes = 64 * 2**20

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
            size = os.fstat(self._f.fileno()).st_size
            n = int.from_bytes(os.pread(self._f.fileno(), 8, 0), "little") if size >= 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            header = json.loads(os.pread(self._f.fileno(), n, 8))
        except (OSError, ValueError) as err:
            self.close()
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({err}); it is "
                                  f"damaged or truncated: {AGAIN}.") from err
        self._start = 8 + n
        try:
            self._info = self._index(header, size)
        except CheckpointError:
            self.close()
            raise

    def _index(self, header: object, size: int
               ) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
        """Each tensor's (dtype, shape, begin, end) in the file, checked as the format
        (and the safetensors library transformers loads with) requires: a JSON object of
        entries whose byte ranges match shape and dtype and tile the data section exactly,
        without gaps or overlaps, to its last byte (a file with bytes past the tensors is as
        damaged as a truncated one)."""
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: the header is a JSON {type(header).__name__}, "
                                  f"not an object; the file is damaged: {AGAIN}.")
        meta = header.pop("__metadata__", None)
        meta = {} if meta is None else meta
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CheckpointError(f"{self.path}: __metadata__ must map names to strings; the "
                                  f"header is damaged: {AGAIN}.")
        self.metadata = meta
        info: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            try:
                dtype = dtypes.BY_SAFETENSORS[entry["dtype"]]
                shape = tuple(_count(x) for x in entry["shape"])
                begin, end = (_count(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{self.path}: bad header entry for {name!r} "
                                      f"({err!r}); the header is damaged: {AGAIN}.") from err
            need = math.prod(shape) * dtype.itemsize
            if end - begin != need:
                raise CheckpointError(f"{self.path}: {name} has {end - begin} bytes, its shape "
                                      f"{shape} and dtype need {need}; the header is damaged: "
                                      f"{AGAIN}.")
            info[name] = (dtype, shape, self._start + begin, self._start + end)
        at = self._start
        for name, (_, _, begin, end) in sorted(info.items(), key=lambda kv: kv[1][2:]):
            if begin != at:
                raise CheckpointError(f"{self.path}: {name} starts at byte {begin}, where "
                                      f"{at} was expected (tensors overlap or leave a gap); the "
                                      f"header is damaged: {AGAIN}.")
            at = end
        if at > size:
            raise CheckpointError(f"{self.path} is truncated: its tensors need {at} bytes, the "
                                  f"file has {size}; {AGAIN}.")
        if at < size:
            raise CheckpointError(f"{self.path} has {size - at} bytes after its last tensor: "
                                  f"it is damaged; {AGAIN}.")
        return info

    def _read_at(self, offset: int, n: int) -> torch.Tensor:
        """``n`` bytes from ``offset`` as a uint8 tensor, read straight into its (uninitialised:
        no zero-fill pass) storage with one large read."""
        buf = torch.empty(n, dtype=torch.uint8)
        view, pos = memoryview(buf.numpy()), 0
        self._f.seek(offset)
        while pos < n:
            got = self._f.readinto(view[pos:])
            if not got:
                raise CheckpointError(f"{self.path}: unexpected end of file at byte "
                                      f"{offset + pos} (truncated).")
            pos += got
        return buf

    def keys(self) -> list[str]:
        return list(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self._info[name][0]

    def _rows(self, name: str, a: int, b: int) -> torch.Tensor:
        dtype, shape, begin, _ = self._info[name]
        row = math.prod(shape[1:]) * dtype.itemsize
        if b <= a or row == 0:
            return torch.empty((max(b - a, 0), *shape[1:]), dtype=dtype.torch)
        data = self._read_at(begin + a * row, (b - a) * row)
        return data.view(dtype.torch).view(b - a, *shape[1:])

    def byte_range(self, name: str, region: tuple[tuple[int, int], ...]
                   ) -> tuple[Path, int, int] | None:
        """Where rows ``region[0]`` of ``name`` lie in the file, when ``region`` spans its inner
        dimensions whole; else None."""
        dtype, shape, begin, end = self._info[name]
        region = tuple(region) + tuple((0, n) for n in shape[len(region):])
        if not shape or len(region) != len(shape) or tuple(region[1:]) != tuple(
                (0, n) for n in shape[1:]):
            return None
        a, b = region[0]
        if not 0 <= a <= b <= shape[0]:
            return None
        row = math.prod(shape[1:]) * dtype.itemsize
        return self.path, begin + a * row, (b - a) * row

    def read(self, name: str, region: tuple[tuple[int, int], ...] | None = None
             ) -> torch.Tensor:
        dtype, shape, begin, end = self._info[name]
        if not shape:
            return self._read_at(begin, end - begin).view(dtype.torch).view(())
        region = tuple(region or ())
        region = region + tuple((0, n) for n in shape[len(region):])
        for (lo, hi), n in zip(region, shape, strict=True):
            if not 0 <= lo <= hi <= n:
                raise CheckpointError(f"{self.path}: region {list(region)} is outside {name} "
                                      f"{shape}.")
        (a, b), inner = region[0], region[1:]
        if all(lo == 0 and hi == n for (lo, hi), n in zip(inner, shape[1:], strict=True)):
            return self._rows(name, a, b)
        index = (slice(None), *(slice(lo, hi) for lo, hi in inner))
        row = max(1, math.prod(shape[1:]) * dtype.itemsize)
        step = max(1, self.block_bytes // row)
        parts = [self._rows(name, r, min(r + step, b))[index].clone() for r in range(a, b, step)]
        if not parts:
            return torch.empty((0, *(hi - lo for lo, hi in inner)), dtype=dtype.torch)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def close(self) -> None:
        f = getattr(self, "_f", None)
        if f is not None:
            f.close()
            self._f = None
