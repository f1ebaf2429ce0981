"""Where the rows come from: local json/jsonl/parquet/text files (globs, folders) or hub
datasets, loaded with ``datasets``; the validation split; where a row is (for errors)."""

from __future__ import annotations

import glob
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.train.data.settings import DataError

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
             ".text": "text"}


def file_type(path: str | Path) -> str:
    """The suffix that names a file's format, past a ``.gz`` (``a.jsonl.gz`` -> ``.jsonl``)."""
    p = Path(path)
    return Path(p.stem).suffix if p.suffix == ".gz" else p.suffix


@dataclass(frozen=True)
class Source:
    """One ``datasets`` load: a builder over local files, or a hub dataset name."""

    builder: str  # json / parquet / text / hub
    files: tuple[str, ...] = ()
    name: str = ""


def resolve_sources(specs: Sequence[str]) -> list[Source]:
    """Expand files, folders and globs; anything else that is not a local path is a hub name."""
    out: list[Source] = []
    for spec in specs:
        if any(ch in spec for ch in "*?["):
            files = sorted(glob.glob(spec, recursive=True))
            if not files:
                raise DataError(f"data source {spec!r}: the glob matches no file.")
        elif Path(spec).is_dir():
            files = sorted(str(p) for p in Path(spec).rglob("*") if file_type(p) in _BUILDERS)
            if not files:
                raise DataError(f"data source {spec!r}: folder holds no "
                                f"{'/'.join(sorted(_BUILDERS))} file.")
        elif Path(spec).is_file():
            files = [spec]
        elif file_type(spec) in _BUILDERS or spec.startswith((".", "/", "~")):
            raise DataError(f"data source {spec!r}: no such file.")
        else:
            out.append(Source("hub", name=spec))
            continue
        for f in files:
            suffix = file_type(f)
            if suffix not in _BUILDERS:
                raise DataError(f"data file {f!r}: unknown type {suffix!r}; use one of "
                                f"{', '.join(sorted(_BUILDERS))}.")
            builder = _BUILDERS[suffix]
            if out and out[-1].builder == builder:
                out[-1] = Source(builder, out[-1].files + (f,))
            else:
                out.append(Source(builder, (f,)))
    return out



@dataclass(frozen=True)
class RowsPart:
    """The rows of one source as a ``datasets.Dataset``. After a split, ``index`` holds each
    row's number in the source (for errors that name the file and line); None: in order."""

    source: Source
    rows: Any
    index: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows)


def _load_source(src: Source) -> list[RowsPart]:
    """The rows of a local source. Its files are loaded together (fast for many shards); files
    whose columns differ (say one file per SFT format) cannot be, so on failure they are loaded
    one by one, which also names the file that cannot be read (and, for JSON, its line)."""
    import datasets

    kwargs = {"sample_by": "paragraph"} if src.builder == "text" else {}
    try:
        return [RowsPart(src, datasets.load_dataset(src.builder, data_files=list(src.files),
                                                    split="train", **kwargs))]
    except Exception as e:  # datasets wraps the reader's error in DatasetGenerationError
        if len(src.files) > 1:
            return [p for f in src.files for p in _load_source(Source(src.builder, (f,)))]
        path = src.files[0]
        cause = e.__cause__ or e
        raise DataError((_bad_json(path) if src.builder == "json" else None)
                        or f"data file {path} could not be read as {src.builder}: "
                           f"{type(cause).__name__}: {cause}") from e


def _first_char(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return line.lstrip()[0]
    return ""


def _bad_json(path: str) -> str | None:
    """Where a JSON / JSON Lines file is malformed (``file:line: ...``), or None if it parses."""
    if _first_char(path) == "[":  # one JSON array
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            at = f"{path}:{e.lineno}" if isinstance(e, json.JSONDecodeError) else path
            return f"{at}: not valid JSON ({e}): fix the file."
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return (f"{path}:{n}: not valid JSON ({e.msg}, column {e.pos + 1}): each line of a "
                        "JSON Lines file must be one complete JSON object; fix or remove the line.")
            if not isinstance(row, dict):
                return (f"{path}:{n}: a JSON Lines row must be an object {{...}}, got "
                        f"{type(row).__name__}.")
    return None


def load_parts(specs: Sequence[str]) -> list[RowsPart]:
    """The rows of each source, in the order given (sources may have different columns)."""
    import datasets

    parts = []
    for src in resolve_sources(specs):
        if src.builder != "hub":
            parts += _load_source(src)
            continue
        try:
            parts.append(RowsPart(src, datasets.load_dataset(src.name, split="train")))
        except Exception as e:  # datasets raises many types for a missing/unreachable name
            raise DataError(f"data source {src.name!r} is neither a local file nor a "
                            f"loadable hub dataset: {e}") from e
    return parts



def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded document-level split (before packing, so no document straddles both sets).
    Returns sorted (train, validation) row indices; at least one validation row when
    fraction > 0 and n >= 2."""
    n_val = int(round(n * fraction))
    if fraction > 0 and n >= 2:
        n_val = min(max(1, n_val), n - 1)
    perm = np.random.default_rng([seed, 0x5EED]).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])



def split_parts(parts: Sequence[RowsPart], fraction: float, seed: int,
                ) -> tuple[list[RowsPart], list[RowsPart]]:
    """``split_indices`` over all rows of all sources (as if concatenated), per source."""
    train, val = split_indices(sum(len(p) for p in parts), fraction, seed)
    out: tuple[list[RowsPart], list[RowsPart]] = ([], [])
    start = 0
    for part in parts:
        for dest, idx in zip(out, (train, val), strict=True):
            mine = idx[(idx >= start) & (idx < start + len(part))] - start
            if len(mine):
                dest.append(RowsPart(part.source, part.rows.select(mine), mine))
        start += len(part)
    return out


def row_location(source: Source, row: int) -> str:
    """``file:line`` of 0-based row ``row`` of a source (JSON Lines), else ``file row N``.
    Reads the files again: for error messages only."""
    if source.builder == "hub":
        return f"hub dataset {source.name!r} row {row + 1}"
    path, local = source.files[0], row
    if len(source.files) > 1:  # the rows are the files' rows in order
        for path in source.files:
            n = len(_load_source(Source(source.builder, (path,)))[0])
            if local < n:
                break
            local -= n
    if source.builder == "json" and _first_char(path) != "[":
        with open(path, encoding="utf-8", errors="replace") as f:
            nonblank = (n for n, line in enumerate(f, 1) if line.strip())
            line = next(itertools.islice(nonblank, local, None), None)
        if line is not None:
            return f"{path}:{line}"
    return f"{path} row {local + 1}"


def source_name(source: Source) -> str:
    if source.builder == "hub":
        return f"hub dataset {source.name!r}"
    more = f" (+{len(source.files) - 1} more files)" if len(source.files) > 1 else ""
    return f"{source.files[0]}{more}"
