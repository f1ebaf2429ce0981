"""The save protocol of a training run's checkpoints (every call is collective).

Synchronous (``checkpoint.async: false``): ``save`` writes this rank's files (``rank_save``:
DeepSpeed builds the state dicts, mdtk writes, hashes and fsyncs them), the ranks agree that
every file is written, and rank 0 publishes the checkpoint (``CheckpointManager.publish``:
manifest, ``trainer_state.json``, rename, ``latest``) before ``save`` returns.

Asynchronous: ``save`` takes a host copy of the state (``snapshot``: what the synchronous save
would write, byte for byte, which later steps cannot change) and returns; the rank's writer
thread writes the files while the steps go on. ``poll`` (at each step boundary: one all-reduce
while a save is in flight) publishes the checkpoint once every rank's writer is done; ``finish``
waits for it (the next save, since at most one is in flight; the run's end; a stop request).
``latest`` moves only at publication, so a crash during the background write leaves the
previous checkpoint as the latest and a ``.tmp-`` folder that resume ignores. The host copy's
buffers are kept for the run (``StagingPool``, reserved before the first save): the memory model
counts them (``checkpoint staging``).

A failed write on any rank (a full disk, any I/O error): the ranks learn it together, rank 0
removes the partial folder, and every rank raises ``SaveError`` with the same message (what
failed, where, the free space; ``checkpoint.on_save_error: stop``) or logs it and trains on
(``continue``).
"""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.errors import UserError
from toolkit.train.checkpoints.folders import (
    CheckpointManager,
    from_rank0,
    gather_all,
    rank_and_world,
)
from toolkit.train.checkpoints.rank_save import (
    MEASURE,
    STAGE,
    WRITE,
    CaptureEngine,
    Failure,
    RankSave,
    Writer,
    capturing,
    check_engine,
)
from toolkit.train.checkpoints.snapshot import StagingPool
from toolkit.train.checkpoints.state import ENGINE_TAG, TrainingState, capture_rng_state, rng_file
from toolkit.train.loop import faults


class SaveError(UserError):
    """A checkpoint that could not be written; the message says what, where and the fix."""


@dataclass(frozen=True)
class SaveTiming:
    """One published (or failed) save: how long the step loop waited for it (snapshot, or the
    whole write when synchronous, plus publication and any wait for the writer) and how long it
    took from its start to its publication."""

    step: int
    blocked_s: float
    total_s: float


@dataclass
class _InFlight:
    state: TrainingState
    tmp: Path
    job: RankSave
    started: float
    blocked: float = 0.0


def _say(message: str) -> None:
    if rank_and_world()[0] == 0:
        print(f"[mdtk train] {message}", flush=True)


def _any(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (one all-reduce)."""
    import torch
    import torch.distributed as dist

    from toolkit import runtime

    if not dist.is_available() or not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32, device=runtime.device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Saver:
    """Saves the checkpoints of one run (``manager`` holds the folders)."""

    def __init__(self, manager: CheckpointManager, *, asynchronous: bool = False,
                 on_error: str = "stop", log: Callable[[str], None] = _say):
        self.manager, self.asynchronous, self.on_error, self.log = (
            manager, asynchronous, on_error, log)
        self.pool = StagingPool() if asynchronous else None
        self.writer = Writer()
        self.flight: _InFlight | None = None
        self.timings: list[SaveTiming] = []

    def prepare(self, engine: Any) -> None:
        """Refuse a checkpoint engine mdtk would bypass. Asynchronous: reserve the staging
        buffers (sizes from one pass through ``save_checkpoint`` that writes nothing; allocated
        and touched by the writer thread while the first steps run)."""
        check_engine(engine)
        if not self.asynchronous or engine.zero_nvme_offload_optimizer():
            return  # NVMe: DeepSpeed copies swap files inside save_checkpoint; nothing to measure
        job = RankSave(0, self.manager.root, rank_and_world()[0])
        with capturing(engine, CaptureEngine(job, MEASURE)):
            engine.save_checkpoint(str(self.manager.root / ".measure"), tag=ENGINE_TAG,
                                   save_latest=False)
        pool = self.pool
        self.writer.submit(lambda: pool.reserve(job.sizes))

    def save(self, engine: Any, state: TrainingState) -> Path | None:
        """Save step ``state.step``: the published folder (synchronous), or None (asynchronous:
        ``poll`` / ``finish`` publish it)."""
        self.finish()  # at most one save in flight
        start = time.perf_counter()
        self.writer.wait()  # the staging buffers are reserved
        rank = rank_and_world()[0]
        tmp, error = self.manager.begin(state.step)
        job = RankSave(state.step, tmp, rank)
        if error is not None:
            job.failure = Failure(0, str(tmp), error)
        else:
            mode = STAGE if self.asynchronous else WRITE
            with capturing(engine, CaptureEngine(job, mode, self.pool)):
                engine.save_checkpoint(str(tmp), tag=ENGINE_TAG, save_latest=False)
            rng = capture_rng_state()  # fresh tensors: nothing later changes them
            (job.stage if self.asynchronous else job.write)(rng, rng_file(tmp, rank))
        self.flight = _InFlight(state, tmp, job, start)
        then = functools.partial(faults.test_hook, "save", state.step)  # tests kill a rank here
        if self.asynchronous:
            self.writer.submit(lambda: job.run(then))
            self.flight.blocked = time.perf_counter() - start
            return None
        job.run(then)
        return self._conclude(start)

    def poll(self) -> Path | None:
        """At a step boundary: publish the save in flight if every rank has written its files
        (one all-reduce while a save is in flight); the published folder, else None."""
        if self.flight is None:
            return None
        start = time.perf_counter()
        if _any(self.writer.busy()):
            self.flight.blocked += time.perf_counter() - start
            return None
        return self._conclude(start)

    def finish(self) -> Path | None:
        """Wait for the save in flight and publish it; the published folder (None: none)."""
        if self.flight is None:
            return None
        start = time.perf_counter()
        self.writer.wait()
        return self._conclude(start)

    def close(self) -> None:
        """On the way out after an error (local, no collective): let a running write end,
        publish nothing (its ``.tmp-`` folder is removed by the next run's save)."""
        try:
            self.writer.wait()
        except Exception:  # noqa: BLE001, S110 - the error that got us here is the one to report
            pass
        self.flight = None

    def _conclude(self, start: float) -> Path | None:
        flight, self.flight = self.flight, None
        parts = gather_all((flight.job.failure, flight.job.records))
        failures = [f for f, _ in parts if f is not None]
        path = None
        if not failures:
            records = [r for _, rs in parts for r in rs]
            path, error = self.manager.publish(flight.state, flight.tmp, records)
            if error is not None:
                failures = [Failure(0, str(flight.tmp), error)]
        if self.pool is not None:
            self.pool.release()
        now = time.perf_counter()
        timing = SaveTiming(flight.state.step, flight.blocked + now - start, now - flight.started)
        self.timings.append(timing)
        if failures:
            self._failed(flight, failures)
            return None
        how = (f" (written in the background in {timing.total_s:.1f} s; the steps waited "
               f"{timing.blocked_s:.2f} s)" if self.asynchronous else "")
        self.log(f"saved checkpoint {path}{how}")
        return path

    def _failed(self, flight: _InFlight, failures: list[Failure]) -> None:
        root = self.manager.root
        usage = from_rank0(tuple(shutil.disk_usage(root)) if root.is_dir() else None)
        self.manager.abandon(flight.tmp)
        latest = self.manager.latest()
        more = f" (and on {len(failures) - 1} more ranks)" if len(failures) > 1 else ""
        space = (f"; {root} has {_size(usage[2])} free of {_size(usage[0])}"
                 + (" (the file system is full)" if usage[2] < usage[0] // 100 else "")
                 if usage else "")
        message = (
            f"checkpoint of step {flight.state.step} could not be saved: {failures[0]}{more}"
            f"{space}. The partial folder {flight.tmp.name} was removed; "
            + (f"the latest checkpoint is still {latest.name}" if latest else
               "there is no earlier checkpoint")
            + ". Free space there or set checkpoint.dir to another file system")
        if self.on_error == "continue":
            self.log(f"warning: {message}; training goes on (checkpoint.on_save_error=continue).")
            return
        raise SaveError(f"{message} (checkpoint.on_save_error=continue trains on without it).")
