"""Hugging Face checkpoint folders: a slice reader and a streaming sharded writer.

The reader parses safetensors headers itself and reads only the bytes of the requested region
of a tensor with positioned reads (``SafetensorsFile``; no memory map, so no file pages stay
counted in the process), so a rank never holds a full tensor it does not own.
Every read is recorded (name, region, bytes) so tests and tools can check exactly what was read.
``.bin`` checkpoints are loaded with ``torch.load(weights_only=True, mmap=True)``: pickle files
are untrusted input, and mmap keeps the untouched parts on disk.

The writer streams tensors into safetensors shards of bounded size inside a temporary sibling
folder, adds the index, ``config.json``, ``generation_config.json`` and tokenizer files, and
renames the folder into place only when everything is written.
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
from toolkit.checkpoint import CheckpointError, formats, fp8
from toolkit.checkpoint.torchfree import dtypes
from toolkit.checkpoint.torchfree.segments import copy_segments
from toolkit.lazy import torch

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "vocab.txt", "spiece.model",
)


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
        """Write shards, index, config and side files, then rename into ``out_dir``."""
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
                for name in TOKENIZER_FILES:
                    if (copy_from / name).is_file():
                        shutil.copy2(copy_from / name, self.tmp / name)
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


def config_json(hf_config: Any, dtype: torch.dtype) -> str:
    """``config.json`` of an HF config (``to_dict()`` of the plain config.json view or of a
    transformers config) with the weights' dtype, as plain JSON: what a conversion writes, so it
    needs no transformers import (~2 s: its config classes pull in DTensor and torch._dynamo)
    and carries the source's config through unchanged but for the dtype."""
    config = hf_config.to_dict()
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    config.pop("quantization_config", None)  # fp8 sources are dequantized: the output is not
    if "torch_dtype" in config:  # the older name of the same key: keep the two in agreement
        config["torch_dtype"] = name
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


@dataclass(frozen=True)
class TextFile:
    """A side file ``HFWriter.finish`` writes as given, where it takes a transformers config
    (both have ``save_pretrained(folder)``)."""

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


# -- registration as a checkpoint format ----------------------------------------------------------

FORMAT = "hf"


def looks_like(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        (path / f).is_file() for f in (SAFE_INDEX, SAFE_SINGLE, BIN_INDEX, BIN_SINGLE))


def open_reader(path: str | Path, out_dtype: torch.dtype | None = None) -> Any:
    """The slice reader of an HF folder: ``HFReader``, wrapped in ``fp8.DequantizingReader``
    when config.json declares fp8 block quantization (weights then come out in ``out_dtype``,
    default the checkpoint's dtype)."""
    reader = HFReader(path)
    config = Path(path) / "config.json"
    try:
        data = json.loads(config.read_text()) if config.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        reader.close()
        raise CheckpointError(f"{config} is not valid JSON ({err}).") from err
    return fp8.dequantizing(reader, data, out_dtype)


def open_source(path: Path, make_adapter: formats.AdapterFactory
                ) -> tuple[Any, Any, dict]:
    """An HF folder as a source (``formats`` opener): its reader (dequantizing fp8 weights),
    adapter and weight files."""
    reader = open_reader(path)
    try:
        adapter = make_adapter(Path(path), {})
    except BaseException:
        reader.close()
        raise
    info: dict = {"files": sorted(set(getattr(reader, "inner", reader).files.values()))}
    if isinstance(reader, fp8.DequantizingReader):
        info["quantization"] = (f"fp8 e4m3, {reader.block[0]}x{reader.block[1]} block scales "
                                f"({len(reader.quantized)} weights, dequantized on read)")
    return reader, adapter, info


formats.register(FORMAT, open_source, looks_like)
