"""One rank's part of a trainer checkpoint: DeepSpeed builds the state dicts, mdtk writes them.

``engine.save_checkpoint`` builds every state dict (ZeRO 0-3, offload, experts, tag checks and
the collectives in between) and hands each to its checkpoint engine with the file to write.
For one save, ``capturing`` puts ``CaptureEngine`` in that place; it either

- ``write``s the file at once (a synchronous save), or
- ``stage``s a host snapshot of it (``snapshot``: what ``torch.save`` would write now, byte for
  byte, that the next optimizer step cannot change) for the writer thread (an asynchronous save),
  or
- ``measure``s the buffers a snapshot needs (at start-up, so the staging pool is ready before
  the first save).

Every write is recorded (size, xxh3-128: the manifest) and every error is kept, never raised:
``save_checkpoint`` has barriers inside, and a rank that left it early would hang the others. The
ranks agree on the outcome afterwards (``toolkit.train.checkpoints.saver``). DeepSpeed's other
write inside ``save_checkpoint``, rank 0's copy of its ``zero_to_fp32.py`` scripts, is wrapped
the same way for the save. (Its copy of NVMe swap files is not: it stays inside DeepSpeed.)
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from toolkit.checkpoint.manifest import FileRecord, record
from toolkit.errors import ConfigError
from toolkit.train.checkpoints.snapshot import StagingPool, snapshot, staging_sizes

WRITE, STAGE, MEASURE = "write", "stage", "measure"


@dataclass(frozen=True)
class Failure:
    """A write that failed on one rank: what was being written and the error."""

    rank: int
    path: str
    error: str

    def __str__(self) -> str:
        return f"rank {self.rank}: writing {self.path} failed ({self.error})"


@dataclass
class RankSave:
    """One rank's files of one save, written now (synchronous) or by ``run`` in the writer
    thread (asynchronous); ``records`` for the manifest, ``failure`` the first error."""

    step: int
    folder: Path
    rank: int
    zipfile: bool = True
    staged: list[tuple[Any, Path]] = field(default_factory=list)
    records: list[FileRecord] = field(default_factory=list)
    failure: Failure | None = None
    sizes: list[tuple[int, bool]] = field(default_factory=list)  # MEASURE

    def fail(self, path: str | Path, error: BaseException) -> None:
        if self.failure is None:
            text = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
            self.failure = Failure(self.rank, str(path), f"{type(error).__name__}: {text}")

    def write(self, state: Any, path: Path) -> None:
        """``torch.save`` by path (torch names the archive's folder after the file, so a buffer
        would not give DeepSpeed's bytes), then fsync and record."""
        if self.failure is not None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path, _use_new_zipfile_serialization=self.zipfile)
            self.add(path)
        except Exception as e:  # noqa: BLE001 - any write error becomes the save's failure
            self.fail(path, e)

    def stage(self, state: Any, path: Path) -> None:
        """Write ``state`` (already a copy nothing else changes) when the job runs."""
        self.staged.append((state, path))

    def add(self, path: Path) -> None:
        """Record a file this rank wrote (hash re-read from the page cache) and fsync it."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records.append(record(self.folder, path))

    def run(self, then: Callable[[], None] | None = None) -> None:
        """Write the staged files; ``then`` (a test hook) runs after them."""
        for state, path in self.staged:
            self.write(state, path)
        self.staged.clear()
        if then is not None:
            then()


class CaptureEngine:
    """DeepSpeed's checkpoint engine for one ``save_checkpoint`` call (duck-typed: DeepSpeed
    calls ``create``, ``makedirs``, ``save``, ``commit`` and asks the questions below)."""

    def __init__(self, job: RankSave, mode: str, pool: StagingPool | None = None):
        self.job, self.mode, self.pool = job, mode, pool

    def create(self, info: Any) -> None:
        pass

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self.mode == MEASURE:
            return
        try:
            os.makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            self.job.fail(path, e)

    def save(self, state_dict: Any, path: str) -> None:
        job = self.job
        try:
            if self.mode == WRITE:
                job.write(state_dict, Path(path))
            elif self.mode == STAGE:
                if job.failure is None:
                    job.stage(snapshot(state_dict, self.pool), Path(path))
            else:
                job.sizes.extend(staging_sizes(state_dict))
        except Exception as e:  # noqa: BLE001 - e.g. no memory for the snapshot
            job.fail(path, e)

    def commit(self, info: Any) -> bool:
        return True

    def is_decoupled(self) -> bool:
        return False

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def preserves_storage_sharing(self) -> bool:
        return True


def check_engine(engine: Any) -> None:
    """Refuse a DeepSpeed config whose checkpoint engine mdtk would silently replace."""
    name = type(engine.checkpoint_engine).__name__
    if name != "TorchCheckpointEngine":
        raise ConfigError(
            f"the DeepSpeed config selects the {name} (its 'checkpoint' block: 'writer' or "
            "'datastates'): mdtk writes the checkpoint files itself (atomic, with a verified "
            "manifest; asynchronous with checkpoint.async: true). Remove that block.")


@contextlib.contextmanager
def capturing(engine: Any, capture: CaptureEngine) -> Iterator[None]:
    """``engine.save_checkpoint`` inside this block writes through ``capture``."""
    base = engine.checkpoint_engine
    capture.job.zipfile = getattr(base, "zipfile_serialization", True)
    copy_scripts = engine._copy_recovery_script

    def scripts(save_path: str) -> None:  # rank 0's copy of zero_to_fp32.py and zero_to_torch.py
        if capture.mode == MEASURE:
            return
        try:
            copy_scripts(save_path)
        except OSError as e:
            capture.job.fail(save_path, e)

    engine.checkpoint_engine = capture
    engine._copy_recovery_script = scripts
    try:
        yield
    finally:
        engine.checkpoint_engine = base
        del engine._copy_recovery_script


class Writer:
    """The rank's background writer: one job at a time in its own thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="mdtk-checkpoint-writer", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
