"""Megatron's indexed dataset files, ``PREFIX.bin`` + ``PREFIX.idx``, read, checked, written and
merged (no megatron-core needed; the training side reads them with megatron-core's own classes).

``.idx``: ``MMIDIDX\\x00\\x00``, ``<Q`` version 1, ``<B`` dtype code, ``<Q`` sequences, ``<Q``
document boundaries (documents + 1), then int32 sequence lengths, int64 byte pointers into the
``.bin`` and int64 document boundaries (sequence indices). ``.bin``: the token ids, back to back.

Two writers use the same header with different codes: megatron-core (1 uint8, 2 int8, 3 int16,
4 int32, 5 int64, 6 float64, 7 float32, 8 uint16) and DeepSpeed's ``data_sampling`` (6 uint16,
7 uint32, 8 uint64). The pointers say how many bytes a token takes, which tells the two apart
for codes 6 and 8; code 7 (4 bytes) is read as DeepSpeed's uint32 (float32 token ids are not a
thing).

``IndexWriter`` writes what megatron-core's ``IndexedDatasetBuilder`` writes, byte for byte, with
memory bounded by a batch: the lengths and document boundaries are spooled to temporary files
and the index is assembled in chunks at the end.
"""

from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolkit.train.data.settings import DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # magic 9 + version 8 + code 1 + sequences 8 + document boundaries 8
_SHARED = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64}
MEGATRON_CODES = {**_SHARED, 6: np.float64, 7: np.float32, 8: np.uint16}
DEEPSPEED_CODES = {**_SHARED, 6: np.uint16, 7: np.uint32, 8: np.uint64}
#: The code megatron-core reads each integer dtype under (uint32/uint64 have none: int32/int64
#: read the same bytes while ids stay below 2**31 / 2**63).
MEGATRON_CODE_OF = {np.dtype(t): c for c, t in MEGATRON_CODES.items()}
MEGATRON_CODE_OF.update({np.dtype(np.uint32): 4, np.dtype(np.uint64): 5})
_CHUNK = 1 << 22  # elements per chunk when streaming an index


def paths(prefix: str | Path) -> tuple[Path, Path]:
    """``(PREFIX.idx, PREFIX.bin)``."""
    return Path(f"{prefix}.idx"), Path(f"{prefix}.bin")


def strip_suffix(spec: str) -> str:
    """``a/b.idx`` or ``a/b.bin`` -> ``a/b``; anything else unchanged."""
    return spec[:-4] if spec.endswith((".idx", ".bin")) else spec


def looks_indexed(spec: str) -> bool:
    """True when ``spec`` names an indexed dataset: its ``.idx`` or ``.bin`` exists."""
    idx, bin_ = paths(strip_suffix(spec))
    return idx.is_file() or bin_.is_file()


@dataclass(frozen=True)
class IndexInfo:
    """What an ``.idx`` says, checked against its ``.bin``."""

    prefix: str
    code: int
    dtype: np.dtype  # the tokens' real element type
    writer: str  # "megatron-core", "DeepSpeed" or "megatron-core or DeepSpeed" (codes 1-5)
    sequences: int
    documents: int
    tokens: int
    bin_bytes: int

    @property
    def megatron_code(self) -> int:
        """The code megatron-core must read these tokens under."""
        return MEGATRON_CODE_OF[self.dtype]

    @property
    def foreign(self) -> bool:
        """True when megatron-core would misread the file's own code (DeepSpeed's 6-8)."""
        return self.megatron_code != self.code


def _element_size(lengths: np.ndarray, pointers: np.ndarray, bin_bytes: int) -> int | None:
    """Bytes per token from the pointers (or the .bin size for a single sequence)."""
    nz = np.flatnonzero(lengths)
    if len(nz) >= 2:
        first, last = int(nz[0]), int(nz[-1])
        span = int(pointers[last]) - int(pointers[first])
        count = int(lengths[first:last].sum(dtype=np.int64))
        return span // count if count and span % count == 0 else None
    tokens = int(lengths.sum(dtype=np.int64))
    return bin_bytes // tokens if tokens and bin_bytes % tokens == 0 else None


def read_index(prefix: str | Path) -> IndexInfo:
    """Read and check the index of ``prefix``: raises ``DataError`` naming the problem and the fix
    (a missing half, a bad header, a ``.bin`` shorter than the index says, float token ids)."""
    prefix = strip_suffix(str(prefix))
    idx, bin_ = paths(prefix)
    if not idx.is_file():
        raise DataError(f"indexed dataset {prefix}: {idx.name} is missing next to {bin_.name}: "
                        "copy both files of the prefix (or re-run the preprocessing).")
    if not bin_.is_file():
        raise DataError(f"indexed dataset {prefix}: {idx} has no {bin_.name} beside it: copy the "
                        "data file too (an index alone holds no tokens).")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != MAGIC:
        raise DataError(f"{idx}: not a Megatron indexed-dataset index (header {head[:9]!r}, "
                        f"expected {MAGIC!r}).")
    version, code, sequences, boundaries = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in MEGATRON_CODES:
        raise DataError(f"{idx}: unknown index version {version} / dtype code {code}.")
    need = HEADER_BYTES + sequences * 12 + boundaries * 8
    if size < need or boundaries < 1:
        raise DataError(f"{idx}: the index is truncated ({size} bytes, its header needs {need} "
                        f"for {sequences} sequences and {boundaries} document boundaries).")
    mm = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, np.int32, sequences, HEADER_BYTES)
    pointers = np.frombuffer(mm, np.int64, sequences, HEADER_BYTES + 4 * sequences)
    tokens = int(lengths.sum(dtype=np.int64))
    bin_bytes = bin_.stat().st_size
    dtype, writer = _dtype_of(str(idx), code, _element_size(lengths, pointers, bin_bytes))
    want = tokens * dtype.itemsize
    if bin_bytes < want:
        raise DataError(f"indexed dataset {prefix}: {bin_.name} holds {bin_bytes:,} bytes but its "
                        f"index describes {tokens:,} tokens of {dtype.itemsize} bytes "
                        f"({want:,} bytes): the .bin is truncated; copy it again.")
    return IndexInfo(prefix, code, dtype, writer, int(sequences), int(boundaries) - 1, tokens,
                     bin_bytes)


def _dtype_of(idx: str, code: int, size: int | None) -> tuple[np.dtype, str]:
    mc, dc = np.dtype(MEGATRON_CODES[code]), np.dtype(DEEPSPEED_CODES[code])
    if mc == dc:
        return mc, "megatron-core or DeepSpeed"
    if code == 7 or size == dc.itemsize:
        return dc, "DeepSpeed"
    if mc.kind == "f":
        raise DataError(f"{idx}: dtype code {code} means {mc.name} token ids for megatron-core "
                        f"and {dc.name} for DeepSpeed, but the pointers say {size} bytes per token "
                        "(neither a DeepSpeed file nor integer ids): re-create it.")
    return mc, "megatron-core"


def sequence_lengths(info: IndexInfo) -> np.ndarray:
    """The int32 length of every sequence (memory-mapped)."""
    mm = np.memmap(paths(info.prefix)[0], mode="r", dtype=np.uint8)
    return np.frombuffer(mm, np.int32, info.sequences, HEADER_BYTES)


def max_token_id(info: IndexInfo) -> int:
    """The largest token id in the ``.bin`` (-1 when empty), scanned in chunks."""
    if not info.tokens:
        return -1
    data = np.memmap(paths(info.prefix)[1], mode="r", dtype=info.dtype, shape=(info.tokens,))
    return int(max(int(data[a:a + _CHUNK].max()) for a in range(0, info.tokens, _CHUNK)))


def describe(prefix: str) -> dict:
    """What ``mdtk inspect PREFIX`` prints: the index, checked, and the largest token id."""
    prefix = strip_suffix(prefix)
    try:
        info = read_index(prefix)
    except DataError as e:
        return {"path": prefix, "format": "Megatron indexed dataset", "problems": [str(e)]}
    codes = "DeepSpeed's" if info.writer == "DeepSpeed" else (
        "megatron-core's" if info.writer == "megatron-core" else "megatron-core's = DeepSpeed's")
    return {"path": prefix, "format": "Megatron indexed dataset",
            "dtype": f"{info.dtype.name} (code {info.code}: {codes} dtype codes)",
            "documents": info.documents, "sequences": info.sequences, "tokens": info.tokens,
            "largest id": max_token_id(info), "bin bytes": info.bin_bytes, "problems": []}


def dtype_for_vocab(vocab_size: int, choice: str = "auto") -> np.dtype:
    """megatron-core's choice (uint16 below 65,500 entries, else int32), or the one asked for;
    a vocab the dtype cannot hold is a ``DataError``."""
    if choice == "auto":
        return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)
    dtype = np.dtype(choice)
    if dtype not in (np.uint8, np.uint16, np.int32, np.int64):
        raise DataError(f"dtype {choice!r}: use auto, uint8, uint16, int32 or int64.")
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise DataError(f"the tokenizer has {vocab_size:,} tokens; ids up to {vocab_size - 1:,} "
                        f"do not fit {dtype.name} (largest {np.iinfo(dtype).max:,}): use int32 or "
                        "auto.")
    return dtype


class IndexWriter:
    """Writes ``PREFIX.bin`` / ``PREFIX.idx`` as megatron-core's ``IndexedDatasetBuilder`` does
    (one sequence per non-empty document; an empty document adds a boundary only), into
    temporary siblings renamed by ``finalize`` (``.bin`` first, the ``.idx`` last)."""

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.idx, self.bin = paths(prefix)
        self.idx.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self.code = MEGATRON_CODE_OF[self.dtype]
        tmp = dict(dir=self.idx.parent, prefix=f".{self.idx.stem}.", suffix=".tmp")
        self._bin = tempfile.NamedTemporaryFile("wb", delete=False, **tmp)
        self._lengths = tempfile.TemporaryFile(dir=self.idx.parent)
        self._bounds = tempfile.TemporaryFile(dir=self.idx.parent)
        self.sequences = 0
        self.documents = 0
        self.tokens = 0

    def add(self, ids: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Documents given as their ids back to back and their lengths (0: an empty document)."""
        doc_lengths = np.asarray(doc_lengths, dtype=np.int32)
        self._bin.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        nonempty = doc_lengths[doc_lengths > 0]
        self._lengths.write(nonempty.tobytes())
        bounds = self.sequences + np.cumsum(doc_lengths > 0, dtype=np.int64)
        self._bounds.write(bounds.tobytes())
        self.sequences += len(nonempty)
        self.documents += len(doc_lengths)
        self.tokens += int(nonempty.sum(dtype=np.int64))

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        with _atomic(self.idx) as out:
            write_index(out, self.code, self.dtype.itemsize,
                        _spooled(self._lengths, np.int32), _spooled(self._bounds, np.int64),
                        self.sequences, self.documents)
        os.replace(self._bin.name, self.bin)
        os.replace(out.name, self.idx)

    def abort(self) -> None:
        self._bin.close()
        Path(self._bin.name).unlink(missing_ok=True)
        self._lengths.close()
        self._bounds.close()


def write_index(out, code: int, itemsize: int, lengths, bounds, sequences: int,
                documents: int) -> None:
    """Write an index to the open file ``out``: ``lengths`` / ``bounds`` are iterables of int32 /
    int64 chunks (``bounds`` without the leading 0)."""
    out.write(MAGIC + struct.pack("<QBQQ", 1, code, sequences, documents + 1))
    ptr = np.int64(0)
    for chunk in lengths():
        out.write(chunk.tobytes())
    for chunk in lengths():
        ends = np.cumsum(chunk, dtype=np.int64) * itemsize
        out.write((ptr + ends - chunk.astype(np.int64) * itemsize).tobytes())
        ptr += ends[-1] if len(ends) else 0
    out.write(np.zeros(1, np.int64).tobytes())
    for chunk in bounds():
        out.write(chunk.tobytes())


def _spooled(f, dtype):
    """A re-iterable reader of a spool file in chunks."""
    def chunks():
        f.seek(0)
        while data := f.read(_CHUNK * np.dtype(dtype).itemsize):
            yield np.frombuffer(data, dtype)
    return chunks


class _atomic:
    """An open temporary sibling of ``path`` (renamed by the caller), removed on error."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.f = tempfile.NamedTemporaryFile("wb", delete=False, dir=self.path.parent,
                                             prefix=f".{self.path.name}.", suffix=".tmp")
        return self.f

    def __exit__(self, exc_type, *rest) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if exc_type is not None:
            Path(self.f.name).unlink(missing_ok=True)


def merge(prefixes: list[str], out_prefix: str | Path) -> IndexInfo:
    """Concatenate indexed datasets (same dtype) into ``out_prefix``, as megatron-core's
    ``IndexedDatasetBuilder.add_index`` + ``finalize`` would (byte for byte), streaming."""
    from toolkit.checkpoint.torchfree.segments import copy_range

    infos = [read_index(p) for p in prefixes]
    if not infos:
        raise DataError("merge needs at least one indexed dataset.")
    dtypes = {(i.code, i.dtype) for i in infos}
    if len(dtypes) > 1:
        raise DataError("the datasets to merge have different dtypes: "
                        + ", ".join(f"{i.prefix}: {i.dtype.name} (code {i.code})" for i in infos))
    idx, bin_ = paths(out_prefix)
    idx.parent.mkdir(parents=True, exist_ok=True)
    with _atomic(bin_) as out:
        for i in infos:
            with open(paths(i.prefix)[1], "rb") as src:
                copy_range(src.fileno(), 0, i.tokens * i.dtype.itemsize, out.fileno())
    first = infos[0]
    with _atomic(idx) as out_idx:
        write_index(out_idx, first.code, first.dtype.itemsize, lambda: _parts(infos, "lengths"),
                    lambda: _parts(infos, "bounds"), sum(i.sequences for i in infos),
                    sum(i.documents for i in infos))
    os.replace(out.name, bin_)
    os.replace(out_idx.name, idx)
    return read_index(out_prefix)


def _parts(infos: list[IndexInfo], what: str):
    """The lengths, or the document boundaries (shifted, leading 0 dropped), of ``infos`` in
    chunks."""
    offset = 0
    for info in infos:
        mm = np.memmap(paths(info.prefix)[0], mode="r", dtype=np.uint8)
        n = info.sequences
        if what == "lengths":
            array, shift = np.frombuffer(mm, np.int32, n, HEADER_BYTES), 0
        else:
            array = np.frombuffer(mm, np.int64, info.documents + 1, HEADER_BYTES + 12 * n)[1:]
            shift = offset
        for a in range(0, len(array), _CHUNK):
            yield array[a:a + _CHUNK] + shift if shift else array[a:a + _CHUNK]
        offset += n
