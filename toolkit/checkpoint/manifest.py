"""The manifest of a checkpoint folder: each file with its size and xxh3-128 checksum, written
when the checkpoint is published and checked before it is used (resume, ``mdtk inspect``).

A flipped bit or a truncated file on a shared file system would otherwise load without a word.
xxh3-128 (the ``xxhash`` package) runs at ~20 GB/s from memory on one core, so reading the files
costs more than hashing them: a writer hashes each file as it finishes it (re-read from the page
cache), and a verifier splits the files among the ranks (``share``) and hashes its share on a
few threads (file reads and xxhash release the GIL). Sizes are always checked (one ``stat`` per
file); ``checksums=False`` skips the hashing where reading a whole checkpoint is too slow.

``manifest.json``::

    {"format": 1, "algorithm": "xxh3_128",
     "files": {"engine/mp_rank_00_model_states.pt": {"size": 40345, "xxh3_128": "9f0c..."}, ...}}

Torch-free; paths are relative to the checkpoint folder, with ``/`` separators.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

MANIFEST = "manifest.json"
ALGORITHM = "xxh3_128"
FORMAT = 1
_CHUNK = 16 << 20


@dataclass(frozen=True, order=True)
class FileRecord:
    """One file of a checkpoint: its path relative to the folder, size and checksum."""

    path: str
    size: int
    checksum: str


@dataclass(frozen=True)
class Problem:
    """What is wrong with one file of a checkpoint."""

    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def hash_file(path: str | Path) -> tuple[int, str]:
    """(size, xxh3-128 hex digest) of a file, read in 16 MiB pieces."""
    digest = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def record(root: str | Path, path: str | Path) -> FileRecord:
    """The record of ``path`` (inside ``root``) as it is on disk now."""
    size, checksum = hash_file(path)
    return FileRecord(Path(path).relative_to(root).as_posix(), size, checksum)


def write(root: str | Path, records: Iterable[FileRecord]) -> Path:
    """``root/manifest.json`` listing ``records`` (fsynced; the caller syncs the folder)."""
    files = {r.path: {"size": r.size, ALGORITHM: r.checksum} for r in sorted(records)}
    path = Path(root) / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "algorithm": ALGORITHM, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return path


def read(root: str | Path) -> list[FileRecord] | None:
    """The records of ``root/manifest.json``; None when the folder has no manifest (written by
    an mdtk before manifests); ValueError naming the file when it cannot be read."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("algorithm") != ALGORITHM:
            raise ValueError(f"algorithm {raw.get('algorithm')!r}, this mdtk checks {ALGORITHM}")
        return [FileRecord(p, int(v["size"]), str(v[ALGORITHM])) for p, v in raw["files"].items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} cannot be read ({e}): the manifest itself is damaged.") from e


def share(records: Sequence[FileRecord], part: int, parts: int) -> list[FileRecord]:
    """The records part ``part`` of ``parts`` checks: largest files first, each to the part with
    the fewest bytes so far (ties to the lower part), so the parts read about as much."""
    load = [0] * parts
    mine = []
    for r in sorted(records, key=lambda r: (-r.size, r.path)):
        owner = min(range(parts), key=lambda i: (load[i], i))
        load[owner] += r.size
        if owner == part:
            mine.append(r)
    return mine


def verify(root: str | Path, records: Sequence[FileRecord] | None = None, *,
           checksums: bool = True, part: int = 0, parts: int = 1,
           threads: int | None = None) -> list[Problem]:
    """The problems of this part's share (``share``) of the checkpoint in ``root``: each file's
    presence, size and (``checksums``) checksum against the manifest. No manifest: no problems
    (the caller decides what an unverifiable checkpoint means); an unreadable one: one problem."""
    root = Path(root)
    if records is None:
        try:
            records = read(root)
        except ValueError as e:
            return [Problem(MANIFEST, str(e))] if part == 0 else []
        if records is None:
            return []
    todo = share(records, part, parts)
    workers = threads or min(4, os.cpu_count() or 1, max(len(todo), 1))
    with ThreadPoolExecutor(workers) as pool:
        found = pool.map(lambda r: _check(root, r, checksums), todo)
        return sorted((p for p in found if p is not None), key=lambda p: p.path)


def _check(root: Path, r: FileRecord, checksums: bool) -> Problem | None:
    try:
        size = (root / r.path).stat().st_size
    except OSError:
        return Problem(r.path, "missing")
    if size != r.size:
        return Problem(r.path, f"{size} bytes, the manifest says {r.size} (truncated or "
                               "overwritten)")
    if checksums:
        _, checksum = hash_file(root / r.path)
        if checksum != r.checksum:
            return Problem(r.path, f"{ALGORITHM} {checksum} differs from the manifest's "
                                   f"{r.checksum} (changed after the save)")
    return None
