"""Outputs appear whole or not at all: write into a temporary sibling, rename when complete.

A rename within one folder is atomic, so a reader (or a user after a crash) sees the old output,
the new one, or nothing; never half a file, never a folder that looks complete but is not.
Temporary siblings are dot-named (``.NAME.tmp-*``) so listings and globs skip them.

Collective writers (the trainer's checkpoints) have their own protocols on top (every rank
writes, rank 0 renames after a barrier). Caches keyed by their inputs (tokenised data, sample
indices, blends) may be built by several writers at once (the local rank 0 of every node over a
shared file system): they use the ``_once`` forms, where the first complete copy stays.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling file."""
    write_bytes(path, text.encode())


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def temp_dir(dst: Path) -> Path:
    """A temporary sibling folder of ``dst`` with the permissions a plain mkdir gives
    (``tempfile.mkdtemp`` makes 0700 folders, which would become the output's mode)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)
    return tmp


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst``, replacing what is there."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / dst.name)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def building(dst: str | Path, publish: Callable[[Path, Path], None] = replace_dir
             ) -> Iterator[Path]:
    """``with building(dst) as tmp:`` fill ``tmp``; on success ``publish`` makes it ``dst``
    (``replace_dir``: replacing it; ``publish_once``: unless a copy is there already), on any
    error it is removed and ``dst`` is left as it was."""
    dst = Path(dst)
    tmp = temp_dir(dst)
    try:
        yield tmp
        publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_once(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst`` unless another writer got there first.

    For content-addressed entries every complete copy is equal; keeping the first means a
    reader never sees ``dst`` vanish (``replace_dir`` moves it aside for a moment) and a late
    writer never fails on it (a rename onto a non-empty folder does). ``src`` is removed."""
    try:
        os.rename(src, dst)
    except OSError:
        if not dst.is_dir():
            raise
    finally:
        shutil.rmtree(src, ignore_errors=True)


def building_once(dst: str | Path) -> contextlib.AbstractContextManager[Path]:
    """``building`` for content-addressed entries (``publish_once``)."""
    return building(dst, publish_once)
