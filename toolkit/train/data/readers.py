"""Documents for tokenising into an indexed dataset, streamed in batches: JSON Lines (also
``.gz``), JSON arrays, Parquet, text (one document per paragraph, as ``datasets`` reads it) and
hub datasets. JSON lines travel raw (the tokenising workers parse them); other formats as
columns. Memory is bounded by a batch.

A shard ``(i, n)`` is a contiguous part of the input (all files in order), so the shards' outputs
merged in order equal one run over everything: the input bytes are cut into n equal ranges and
each unit belongs to the shard where it starts (a JSON line; a row group of a Parquet file; a
whole file for compressed, JSON-array and text files, which cannot be entered in the middle).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.train.data.settings import DataError
from toolkit.train.data.sources import Source, resolve_sources


@dataclass
class Batch:
    """Documents: raw JSON ``lines`` or ``columns`` (key -> values), consecutive in ``path``
    from line (JSON Lines) or row ``first`` (1-based; for a shard that starts inside a file:
    the first line after byte ``offset``)."""

    path: str
    first: int
    lines: list[bytes] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)
    nbytes: int = 0
    offset: int | None = None
    unit: str = "line"

    def __len__(self) -> int:
        return len(self.lines) if self.lines else len(next(iter(self.columns.values()), []))

    def where(self, n: int) -> str:
        """The ``n``-th document of the batch, for errors."""
        if self.offset is not None:
            return f"{self.path} {self.unit} {self.first + n} after byte {self.offset}"
        sep = ":" if self.unit == "line" else f" {self.unit} "
        return f"{self.path}{sep}{self.first + n}"


@dataclass(frozen=True)
class _Unit:
    """A file (or a hub dataset) and where its bytes start in the concatenated input."""

    source: Source
    path: str
    start: int
    size: int


def plan_inputs(specs: Sequence[str]) -> list[_Unit]:
    """The input files in order (folders and globs expanded), hub datasets as size-0 units."""
    units, start = [], 0
    for src in resolve_sources(specs):
        for path in src.files or (src.name,):
            size = Path(path).stat().st_size if src.builder != "hub" else 0
            units.append(_Unit(src, path, start, size))
            start += size
    return units


def total_bytes(units: Sequence[_Unit]) -> int:
    return sum(u.size for u in units)


def read_batches(units: Sequence[_Unit], keys: Sequence[str], batch_docs: int = 1024,
                 batch_bytes: int = 16 << 20, shard: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
    """The documents of shard ``shard`` of ``units``, in order, in batches of at most
    ``batch_docs`` documents / about ``batch_bytes`` bytes."""
    i, n = shard
    total = total_bytes(units)
    lo, hi = total * i // n, total * (i + 1) // n
    hubs = [u for u in units if u.source.builder == "hub"]
    for u in units:
        if u.source.builder == "hub":
            yield from _hub(u, keys, batch_docs, hubs.index(u), len(hubs), shard)
        elif u.size and not (u.start + u.size > lo and u.start < hi):
            continue  # no byte of this file in the shard's range
        elif u.source.builder == "parquet":
            yield from _parquet(u, keys, batch_docs, lo, hi)
        elif u.source.builder == "json" and not u.path.endswith(".gz") \
                and _first_char(u.path) != "[":
            yield from _json_lines(u, batch_docs, batch_bytes, lo, hi)
        elif lo <= u.start < hi or (u.size == 0 and i == 0):
            yield from _whole_file(u, keys, batch_docs)


def _first_char(path: str) -> str:
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                return chr(line.lstrip()[0])
    return ""


def _json_lines(u: _Unit, batch_docs: int, batch_bytes: int, lo: int, hi: int,
                ) -> Iterator[Batch]:
    """The lines of a JSON Lines file that start in [lo, hi) of the concatenated input; a
    batch holds consecutive lines (a blank line ends it)."""
    begin, end = max(lo - u.start, 0), min(hi - u.start, u.size)
    with open(u.path, "rb") as f:
        if begin:
            f.seek(begin - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line under way belongs to the shard before
        pos = f.tell()
        offset = pos if pos else None
        line_no, batch, size = 1, [], 0
        while pos < end:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            if line.strip():
                batch.append(line)
                size += len(line)
            if batch and (not line.strip() or len(batch) >= batch_docs or size >= batch_bytes):
                yield Batch(u.path, line_no, lines=batch, nbytes=size, offset=offset)
                line_no, batch, size = line_no + len(batch), [], 0
            if not line.strip():
                line_no += 1
        if batch:
            yield Batch(u.path, line_no, lines=batch, nbytes=size, offset=offset)


def _parquet(u: _Unit, keys: Sequence[str], batch_docs: int, lo: int, hi: int,
             ) -> Iterator[Batch]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(u.path)
    groups = pf.metadata.num_row_groups
    mine = [g for g in range(groups) if lo <= u.start + g * u.size // groups < hi]
    missing = [k for k in keys if k not in pf.schema_arrow.names]
    if missing:
        raise DataError(f"{u.path} has no {missing[0]!r} column (columns: "
                        f"{pf.schema_arrow.names}); set data.text_field (mdtk data preprocess: "
                        "--json-keys).")
    row = sum(pf.metadata.row_group(g).num_rows for g in range(mine[0])) if mine else 0
    for rb in (pf.iter_batches(batch_size=batch_docs, row_groups=mine, columns=list(keys))
               if mine else ()):
        cols = {k: rb.column(k).to_pylist() for k in keys}
        yield Batch(u.path, row + 1, columns=cols, unit="row",
                    nbytes=u.size * rb.num_rows // max(pf.metadata.num_rows, 1))
        row += rb.num_rows


def _whole_file(u: _Unit, keys: Sequence[str], batch_docs: int) -> Iterator[Batch]:
    """JSON arrays, compressed JSON Lines and text files: read from their start."""
    opener = gzip.open if u.path.endswith(".gz") else open
    if u.source.builder == "text":
        with opener(u.path, "rt", encoding="utf-8") as f:
            docs = [p for p in f.read().split("\n\n") if p]
        rows: Iterator = ({keys[0]: d} for d in docs)
    elif u.path.endswith(".gz") and _gz_first_char(u.path) != "[":
        yield from _gz_lines(u, batch_docs)
        return
    else:
        with opener(u.path, "rt", encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{u.path}:{e.lineno}: not valid JSON ({e.msg}): fix the "
                                "file.") from None
        if not isinstance(data, list):
            raise DataError(f"{u.path}: a JSON file must hold one array of objects or one object "
                            "per line.")
        rows = iter(data)
    yield from _row_batches(u, rows, keys, batch_docs)


def _gz_first_char(path: str) -> str:
    with gzip.open(path, "rb") as f:
        return chr(f.read(4096).lstrip()[:1][0]) if f.peek(1) else ""


def _gz_lines(u: _Unit, batch_docs: int) -> Iterator[Batch]:
    with gzip.open(u.path, "rb") as f:
        batch, size, line_no, first = [], 0, 0, 1
        for line in f:
            line_no += 1
            if line.strip():
                batch.append(line)
                size += len(line)
            if batch and (not line.strip() or len(batch) >= batch_docs):
                yield Batch(u.path, first, lines=batch, nbytes=size)
                batch, size = [], 0
            if not batch:
                first = line_no + 1
        if batch:
            yield Batch(u.path, first, lines=batch, nbytes=size)


def _row_batches(u: _Unit, rows: Iterator, keys: Sequence[str], batch_docs: int,
                 ) -> Iterator[Batch]:
    cols: dict[str, list] = {k: [] for k in keys}
    first = n = 0
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{u.path} row {n + 1}: a row must be an object {{...}}, got "
                            f"{type(row).__name__}.")
        for k in keys:
            cols[k].append(row.get(k))
        if len(cols[keys[0]]) >= batch_docs:
            yield Batch(u.path, first + 1, columns=cols, unit="row")
            cols, first = {k: [] for k in keys}, n + 1
    if cols[keys[0]]:
        yield Batch(u.path, first + 1, columns=cols, unit="row")


def _hub(u: _Unit, keys: Sequence[str], batch_docs: int, index: int, count: int,
         shard: tuple[int, int]) -> Iterator[Batch]:
    import datasets

    try:
        ds = datasets.load_dataset(u.path, split="train")
    except Exception as e:  # datasets raises many types for a missing/unreachable name
        raise DataError(f"data source {u.path!r} is neither a local file nor a loadable hub "
                        f"dataset: {e}") from e
    if shard[1] > 1:
        ds = ds.shard(shard[1], shard[0], contiguous=True)
    missing = [k for k in keys if k not in ds.column_names]
    if missing:
        raise DataError(f"hub dataset {u.path!r} has no {missing[0]!r} column (columns: "
                        f"{ds.column_names}); set data.text_field (mdtk data preprocess: "
                        "--json-keys).")
    row = 0
    for chunk in ds.select_columns(list(keys)).iter(batch_size=batch_docs):
        yield Batch(f"hub dataset {u.path!r}", row + 1, columns=dict(chunk), unit="row")
        row += len(chunk[keys[0]])
