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
                                  "damaged or truncated.") from err
        self.metadata = header.pop("__metadata__", None) or {}
        self._start = 8 + n
        self._info: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        end_max = 0
        for name, info in header.items():
            try:
                dtype = dtypes.BY_SAFETENSORS[info["dtype"]]
                shape = tuple(int(x) for x in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                self.close()
                raise CheckpointError(f"{self.path}: bad header entry for {name!r} "
                                      f"({err!r}).") from err
            if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                self.close()
                need = math.prod(shape) * dtype.itemsize
                raise CheckpointError(f"{self.path}: {name} has {end - begin} bytes, its shape "
                                      f"{shape} and dtype need {need}.")
            self._info[name] = (dtype, shape, self._start + begin, self._start + end)
            end_max = max(end_max, end)
        if self._start + end_max > size:
            self.close()
            raise CheckpointError(f"{self.path} is truncated: its tensors need "
                                  f"{self._start + end_max} bytes, the file has {size}.")

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
