"""Hugging Face checkpoint folders: a slice reader and a streaming sharded writer.

The reader opens safetensors files lazily and reads only the requested region of a tensor
(``safe_open(...).get_slice(name)[...]``), so a rank never holds a full tensor it does not own.
Every read is recorded (name, region, bytes) so tests and tools can check exactly what was read.
``.bin`` checkpoints are loaded with ``torch.load(weights_only=True, mmap=True)``: pickle files
are untrusted input, and mmap keeps the untouched parts on disk.

The writer streams tensors into safetensors shards of bounded size inside a temporary sibling
folder, adds the index, ``config.json``, ``generation_config.json`` and tokenizer files, and
renames the folder into place only when everything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "vocab.txt", "spiece.model",
)
_SAFE_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used as given; the message names the file or tensor."""


@dataclass(frozen=True)
class ReadRecord:
    name: str
    region: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]
    nbytes: int


class HFReader:
    """Read regions of the tensors of an HF checkpoint folder (safetensors or .bin)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a folder.")
        self.files = _weight_map(self.path)
        self.kind = "bin" if next(iter(self.files.values())).endswith(".bin") else "safetensors"
        self.reads: list[ReadRecord] = []
        self._open: dict[str, Any] = {}

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._open.clear()

    @property
    def names(self) -> list[str]:
        return list(self.files)

    def _handle(self, name: str) -> Any:
        if name not in self.files:
            raise CheckpointError(f"{self.path} has no tensor {name!r}.")
        file = self.files[name]
        if file not in self._open:
            full = self.path / file
            if not full.is_file():
                raise CheckpointError(f"{full} is listed in the index but missing.")
            if self.kind == "safetensors":
                self._open[file] = safe_open(str(full), framework="pt")
            else:
                self._open[file] = _load_bin(full)
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        h = self._handle(name)
        if self.kind == "safetensors":
            return tuple(h.get_slice(name).get_shape())
        return tuple(h[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        h = self._handle(name)
        if self.kind == "safetensors":
            return _SAFE_DTYPES[h.get_slice(name).get_dtype()]
        return h[name].dtype

    def read(self, name: str, region: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The region ``[(start, stop), ...]`` of tensor ``name``; only that region is read."""
        index = tuple(slice(a, b) for a, b in region)
        h = self._handle(name)
        if self.kind == "safetensors":
            t = h.get_slice(name)[index]
        else:
            t = h[name][index].clone()
        self.reads.append(ReadRecord(name, tuple(region), tuple(t.shape),
                                     t.numel() * t.element_size()))
        return t


def _weight_map(path: Path) -> dict[str, str]:
    for index, single in ((SAFE_INDEX, SAFE_SINGLE), (BIN_INDEX, BIN_SINGLE)):
        if (path / index).is_file():
            data = json.loads((path / index).read_text())
            if "weight_map" not in data:
                raise CheckpointError(f"{path / index} has no 'weight_map'.")
            return dict(data["weight_map"])
        if (path / single).is_file():
            if single.endswith(".safetensors"):
                with safe_open(str(path / single), framework="pt") as f:
                    return {k: single for k in f.keys()}
            return {k: single for k in _load_bin(path / single)}
    raise CheckpointError(
        f"{path} has no weights: expected {SAFE_INDEX}, {SAFE_SINGLE}, {BIN_INDEX} or "
        f"{BIN_SINGLE}."
    )


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) pickle files cannot be memory-mapped
        return torch.load(file, map_location="cpu", weights_only=True)


class HFWriter:
    """Stream tensors into ``out_dir`` as sharded safetensors + index, written atomically.

    ``add`` tensors in order, then ``finish`` with the config; nothing appears at ``out_dir``
    until ``finish`` renames the temporary sibling folder into place. Memory held: at most one
    shard (``max_shard_bytes``).
    """

    def __init__(self, out_dir: str | Path, *, max_shard_bytes: int = 5 * 2**30,
                 overwrite: bool = False):
        self.out_dir = Path(out_dir).resolve()
        if self.out_dir.exists() and not overwrite:
            raise CheckpointError(f"{self.out_dir} exists: choose a new folder or pass "
                                  "overwrite=True (--overwrite).")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-",
                                         dir=self.out_dir.parent))
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total = 0
        self._seen: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise CheckpointError(f"tensor {name!r} written twice.")
        self._seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        save_file(self._pending, str(self.tmp / f"shard-{len(self._shards):05d}.safetensors"),
                  metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self, config: Any, *, generation_config: Any = None,
               copy_from: Path | None = None) -> Path:
        """Write shards, index, config and side files, then rename into ``out_dir``."""
        try:
            self._flush()
            n = len(self._shards)
            weight_map = {}
            for i, names in enumerate(self._shards):
                final = SAFE_SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(self.tmp / f"shard-{i:05d}.safetensors", self.tmp / final)
                weight_map.update({name: final for name in names})
            if n > 1:
                index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
                (self.tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
            config.save_pretrained(self.tmp)
            if generation_config is not None:
                generation_config.save_pretrained(self.tmp)
            if copy_from is not None:
                for name in TOKENIZER_FILES:
                    if (copy_from / name).is_file():
                        shutil.copy2(copy_from / name, self.tmp / name)
            _replace_dir(self.tmp, self.out_dir)
        except BaseException:
            self.abort()
            raise
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _replace_dir(src: Path, dst: Path) -> None:
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / dst.name)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)
