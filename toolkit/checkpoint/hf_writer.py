"""Hugging Face checkpoint folders written: safetensors shards streamed into a temporary sibling.

``HFWriter`` streams tensors into safetensors shards of bounded size inside a temporary sibling
folder, adds the index, ``config.json``, ``generation_config.json`` and tokenizer files, and
renames the folder into place only when everything is written. With a plan (every tensor's
shape and dtype up front) each tensor goes to its shard file as it arrives, from memory or as
byte ranges of other files copied in the kernel (``add_segments``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.atomic import replace_dir, temp_dir
from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.hf import SAFE_INDEX, SAFE_SINGLE, copy_side_files
from toolkit.checkpoint.torchfree import dtypes
from toolkit.checkpoint.torchfree.segments import copy_segments
from toolkit.lazy import torch


class HFWriter:
    """Stream tensors into ``out_dir`` as sharded safetensors + index, written atomically.

    ``add`` tensors in order, then ``finish`` with the config; nothing appears at ``out_dir``
    until ``finish`` renames the temporary sibling folder into place. Memory held: at most one
    shard (``max_shard_bytes``).

    With ``plan`` (``{name: (shape, dtype)}`` of every tensor, in the order they will be added)
    the shards are laid out up front and each tensor is written to its shard file as soon as it
    is added (header first, then the data), so memory holds only the tensor being added and a
    shard file is complete when its last tensor arrives.
    """

    def __init__(self, out_dir: str | Path, *, max_shard_bytes: int = 5 * 2**30,
                 overwrite: bool = False,
                 plan: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None):
        self.out_dir = Path(out_dir).resolve()
        if self.out_dir.exists() and not overwrite:
            raise CheckpointError(f"{self.out_dir} exists: choose a new folder or pass "
                                  "overwrite=True (--overwrite).")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = temp_dir(self.out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total = 0
        self._seen: set[str] = set()
        self.fsync = False  # flush every file to disk before the rename
        self._plan = None
        if plan is not None:
            self._plan = _StreamPlan(plan, max_shard_bytes)
            self._shards = self._plan.shards

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise CheckpointError(f"tensor {name!r} written twice.")
        self._seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._plan is not None:
            self._plan.write(self.tmp, name, tensor)
            self._total += nbytes
            return
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self._total += nbytes

    def add_segments(self, name: str, segments: list[tuple[Any, int, int]]) -> None:
        """Add tensor ``name`` (planned) from ``(file, offset, length)`` byte ranges of other
        files, copied file to file in the kernel (``copy_file_range``), never through memory."""
        if name in self._seen:
            raise CheckpointError(f"tensor {name!r} written twice.")
        if self._plan is None:
            raise CheckpointError("add_segments needs a planned writer (plan=...).")
        self._seen.add(name)
        self._plan.write_segments(self.tmp, name, segments)
        self._total += sum(n for _, _, n in segments)

    def _flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file

        save_file(self._pending, str(self.tmp / f"shard-{len(self._shards):05d}.safetensors"),
                  metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self, config: Any, *, generation_config: Any = None,
               copy_from: Path | None = None) -> Path:
        """Write shards, index, config and side files, then rename into ``out_dir``.

        ``config`` writes the model's config.json with ``save_pretrained(folder)``
        (``toolkit.adapters.spec.ConfigFile``; a transformers config also works); None: a
        folder of tensors only."""
        try:
            n = len(self._shards)
            weight_map = {}
            if self._plan is not None:
                self._plan.check_complete()
                for i, names in enumerate(self._shards):
                    weight_map.update(dict.fromkeys(names, self._plan.file_name(i)))
            else:
                self._flush()
                n = len(self._shards)
            for i, names in enumerate(self._shards if self._plan is None else []):
                final = SAFE_SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(self.tmp / f"shard-{i:05d}.safetensors", self.tmp / final)
                weight_map.update({name: final for name in names})
            if n > 1:
                index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
                (self.tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
            if config is not None:  # None: a folder of tensors only (kept-aside extras)
                config.save_pretrained(self.tmp)
            if generation_config is not None:
                generation_config.save_pretrained(self.tmp)
            if copy_from is not None:
                copy_side_files(copy_from, self.tmp)
            if self.fsync:
                for f in self.tmp.iterdir():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            replace_dir(self.tmp, self.out_dir)
        except BaseException:
            self.abort()
            raise
        return self.out_dir

    def abort(self) -> None:
        if self._plan is not None:
            self._plan.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass(frozen=True)
class TextFile:
    """A side file ``HFWriter.finish`` writes as given, where it takes a transformers
    generation config (both have ``save_pretrained(folder)``)."""

    name: str
    text: str

    def save_pretrained(self, folder: str | Path) -> None:
        (Path(folder) / self.name).write_text(self.text)


class _StreamPlan:
    """Shard layout decided before any data: each shard file gets its header, then its tensors'
    bytes as they are added (in plan order)."""

    def __init__(self, plan: dict[str, tuple[tuple[int, ...], torch.dtype]], max_bytes: int):
        self.plan = {n: (tuple(s), d) for n, (s, d) in plan.items()}
        self.shards: list[list[str]] = []
        size = 0
        for name, (shape, dtype) in self.plan.items():
            nbytes = math.prod(shape) * dtype.itemsize
            if not self.shards or (size and size + nbytes > max_bytes):
                self.shards.append([])
                size = 0
            self.shards[-1].append(name)
            size += nbytes
        self.shard_of = {n: i for i, names in enumerate(self.shards) for n in names}
        self.order = list(self.plan)
        self._next = 0
        self._file: Any = None
        self._file_index = -1

    def file_name(self, i: int) -> str:
        n = len(self.shards)
        return SAFE_SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"

    def _header(self, i: int) -> bytes:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in self.shards[i]:
            shape, dtype = self.plan[name]
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": dtypes.of(dtype).safetensors, "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        return len(raw).to_bytes(8, "little") + raw

    def write(self, folder: Path, name: str, tensor: torch.Tensor) -> None:
        self._check_next(name)
        shape, dtype = self.plan[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the plan "
                                  f"says {shape} {dtype}.")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._open_for(folder, name).write(memoryview(data.numpy()))
        self._done(name)

    def write_segments(self, folder: Path, name: str,
                       segments: list[tuple[Any, int, int]]) -> None:
        """Tensor ``name``'s bytes copied from ``(file, offset, length)`` ranges, in order."""
        self._check_next(name)
        shape, dtype = self.plan[name]
        need = math.prod(shape) * dtype.itemsize
        if sum(n for _, _, n in segments) != need:
            raise CheckpointError(f"{name}: segments hold {sum(n for _, _, n in segments)} "
                                  f"bytes, the plan says {need}.")
        out = self._open_for(folder, name)
        out.flush()
        copy_segments(segments, out.fileno())
        self._done(name)

    def _check_next(self, name: str) -> None:
        if self._next >= len(self.order) or self.order[self._next] != name:
            want = self.order[self._next] if self._next < len(self.order) else "nothing"
            raise CheckpointError(f"writer expected {want}, got {name!r}.")

    def _open_for(self, folder: Path, name: str) -> Any:
        """The shard file of ``name``, opened (header written) when it is its first tensor."""
        i = self.shard_of[name]
        if i != self._file_index:
            self.close()
            self._file = open(folder / self.file_name(i), "wb")  # noqa: SIM115
            self._file.write(self._header(i))
            self._file_index = i
        return self._file

    def _done(self, name: str) -> None:
        self._next += 1
        if name == self.shards[self.shard_of[name]][-1]:
            self.close()

    def check_complete(self) -> None:
        if self._next != len(self.order):
            raise CheckpointError(f"writer got {self._next} of {len(self.order)} planned "
                                  f"tensors (next: {self.order[self._next]}).")
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
