"""Hugging Face checkpoint folders: their file names, the slice reader, the format registration.

The reader parses safetensors headers itself and reads only the bytes of the requested region
of a tensor with positioned reads (``SafetensorsFile``; no memory map, so no file pages stay
counted in the process), so a rank never holds a full tensor it does not own.
Every read is recorded (name, region, bytes) so tests and tools can check exactly what was read.
``.bin`` checkpoints are loaded with ``torch.load(weights_only=True, mmap=True)``: pickle files
are untrusted input, and mmap keeps the untouched parts on disk.

The writer is ``hf_writer.HFWriter``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError, formats, fp8, mxfp4
from toolkit.checkpoint.safetensors_file import SafetensorsFile
from toolkit.checkpoint.source import Opening, TensorSource
from toolkit.checkpoint.stacked import stacked
from toolkit.lazy import torch
from toolkit.mapping.stacked import Stack

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
#: The model's config: its name only here (format detection, ``hf_config/`` folders); it is
#: read and written by ``toolkit.adapters.spec`` alone, a layer above.
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "vocab.txt", "spiece.model",
)


def copy_side_files(src: Path, dst: Path, names: tuple[str, ...] = TOKENIZER_FILES) -> list[str]:
    """Copy the files of ``names`` that ``src`` has (tokenizer files by default) into ``dst``;
    the names copied."""
    import shutil

    copied = [name for name in names if (src / name).is_file()]
    for name in copied:
        shutil.copy2(src / name, dst / name)
    return copied


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
        if not self.files:
            raise CheckpointError(f"{self.path}: the checkpoint lists no tensors.")
        self.kind = "bin" if next(iter(self.files.values())).endswith(".bin") else "safetensors"
        self.reads: list[ReadRecord] = []
        self._open: dict[str, Any] = {}
        # Every listed file must exist, and a safetensors header must parse and cover the file
        # (safetensors checks that when opening): damage shows before anything is written.
        for file in sorted(set(self.files.values())):
            full = self.path / file
            if not full.is_file():
                raise CheckpointError(f"{full} is listed in the index but missing.")
            if self.kind == "safetensors":
                self._open[file] = _safe_open(full)

    def locate(self, name: str) -> Path:
        """The file holding tensor ``name``."""
        return self.path / self.files[name]

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for h in self._open.values():
            if isinstance(h, SafetensorsFile):
                h.close()
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
                self._open[file] = _safe_open(full)
            else:
                self._open[file] = _load_bin(full)
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        h = self._handle(name)
        if self.kind == "safetensors":
            return tuple(h.shape(name))
        return tuple(h[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        h = self._handle(name)
        if self.kind == "safetensors":
            return h.dtype(name)
        return h[name].dtype

    def byte_range(self, name: str, region: tuple[tuple[int, int], ...]
                   ) -> tuple[Path, int, int] | None:
        """``(file, offset, length)`` of the region's bytes as stored, when the region is whole
        rows of a safetensors tensor (one contiguous range: a writer can copy it file to file);
        None otherwise (``.bin`` files, inner-dimension cuts)."""
        if self.kind != "safetensors":
            return None
        h = self._handle(name)
        if name not in h._info:
            return None
        return h.byte_range(name, tuple(region))

    def read(self, name: str, region: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The region ``[(start, stop), ...]`` of tensor ``name``; only that region is read."""
        index = tuple(slice(a, b) for a, b in region)
        h = self._handle(name)
        if self.kind == "safetensors":
            if name not in h._info:
                raise CheckpointError(f"{self.locate(name)} does not hold {name}, although the "
                                      "index says so.")
            t = h.read(name, tuple(region))
        else:
            t = h[name][index].clone()
        self.reads.append(ReadRecord(name, tuple(region), tuple(t.shape),
                                     t.numel() * t.element_size()))
        return t


def _safe_open(file: Path) -> SafetensorsFile:
    return SafetensorsFile(file)


def _weight_map(path: Path) -> dict[str, str]:
    for index, single in ((SAFE_INDEX, SAFE_SINGLE), (BIN_INDEX, BIN_SINGLE)):
        if (path / index).is_file():
            try:
                data = json.loads((path / index).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise CheckpointError(f"{path / index} is not valid JSON ({err}).") from err
            if "weight_map" not in data:
                raise CheckpointError(f"{path / index} has no 'weight_map'.")
            return dict(data["weight_map"])
        if (path / single).is_file():
            if single.endswith(".safetensors"):
                f = _safe_open(path / single)
                try:
                    return dict.fromkeys(f.keys(), single)
                finally:
                    f.close()
            return {k: single for k in _load_bin(path / single)}
    raise CheckpointError(
        f"{path} has no weights: expected {SAFE_INDEX}, {SAFE_SINGLE}, {BIN_INDEX} or "
        f"{BIN_SINGLE}."
    )


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin`` shard: ``torch.load(weights_only=True)`` (no code runs)."""
    from toolkit.checkpoint.torchfree.safe_load import load_torch

    state = load_torch(file)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise CheckpointError(f"{file}: expected a dict of tensors.")
    return state


# -- registration as a checkpoint format ----------------------------------------------------------

FORMAT = "hf"


def looks_like(path: Path) -> bool:
    return (path / CONFIG).is_file() and any(
        (path / f).is_file() for f in (SAFE_INDEX, SAFE_SINGLE, BIN_INDEX, BIN_SINGLE))


def open_reader(path: str | Path, config: Any, out_dtype: torch.dtype | None = None, *,
                stacks: Sequence[Stack] = (), base_prefix: str = "") -> TensorSource:
    """The slice reader of an HF folder: ``HFReader``, wrapped in a dequantizing reader when its
    ``config`` (the folder's config.json as read, a mapping) declares fp8 block quantization
    (``fp8``) or MXFP4 experts (``mxfp4``; weights then come out in ``out_dtype``, default the
    checkpoint's dtype), then in ``stacked.StackedReader`` when the model stores ``stacks``."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method == mxfp4.METHOD:
        reader = mxfp4.dequantizing(HFReader(path), config, out_dtype)
    else:
        reader = mxfp4.dense_blocks(fp8.dequantizing(HFReader(path), config, out_dtype))
    try:
        return stacked(reader, stacks, base_prefix)
    except BaseException:
        reader.close()
        raise


def bottom(reader: Any) -> Any:
    """The innermost reader under any wrappers (the ``HFReader``)."""
    while hasattr(reader, "inner"):
        reader = reader.inner
    return reader


def open_source(path: Path, make_adapter: formats.AdapterFactory) -> Opening:
    """An HF folder as a source (``formats`` opener): its reader (dequantizing quantized
    weights, members of stacked tensors under their own names), adapter and weight files."""
    adapter = make_adapter(Path(path), {})  # first: config.json's own checks name its keys
    reader = open_reader(path, _plain(adapter.hf_config), stacks=adapter.stacks,
                         base_prefix=adapter.family.base_prefix)
    info: dict = {"files": sorted(set(bottom(reader).files.values()))}
    for layer in (reader, getattr(reader, "inner", None)):
        if isinstance(layer, fp8.DequantizingReader):
            info["quantization"] = (f"fp8 e4m3, {layer.block[0]}x{layer.block[1]} block scales "
                                    f"({len(layer.quantized)} weights, dequantized on read)")
        elif isinstance(layer, mxfp4.DenseBlocksReader):
            info["quantization"] = (
                f"none: {len(layer.renamed)} dense weights stored under *_blocks names (as "
                "transformers saves a model loaded with Mxfp4Config(dequantize=True)), read as "
                "the weights they are")
        elif isinstance(layer, mxfp4.Mxfp4Reader):
            info["quantization"] = (
                f"mxfp4 experts, 32-value blocks ({len(layer.quantized)} weights, dequantized "
                "on read" + ("; blocks along the output dimension, as transformers' on-the-fly "
                             "quantizer saves them)" if layer.along_out else ")"))
    return Opening(reader, adapter, info)


def _plain(hf: Any) -> Any:
    """A config as a mapping (``.get``): the plain JSON view as is, a transformers config's
    dict (a live model's adapter reads transformers' config object)."""
    return hf if hasattr(hf, "get") else hf.to_dict()


formats.register(FORMAT, open_source, looks_like)
