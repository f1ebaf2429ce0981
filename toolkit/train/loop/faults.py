"""Fault tolerance of a running training job: a graceful stop on request, and a heartbeat
watchdog that ends a rank that stopped making progress.

Stop: SIGTERM or SIGUSR1 to any rank, or the stop file (``MDTK_STOP_FILE``, default
``{output_dir}/STOP``; the Slurm script creates it shortly before the time limit), asks for a
stop. At every step boundary the ranks agree with one all-reduce (any rank asked -> all stop),
save a checkpoint and exit with ``errors.EXIT_STOPPED``; the next launch resumes from it
(``checkpoint.resume: auto``). A second signal while a stop is pending kills the rank at once.

Heartbeat: a daemon thread per rank ends the process (``os._exit(errors.EXIT_HUNG)``) when no
step has completed within ``runtime.heartbeat_timeout_s``: a rank stuck in a collective whose
peer hung never returns to Python, so only a thread can notice; the launcher then sees a failed
rank and restarts or fails the group instead of waiting for the scheduler's time limit.

Test hooks (``MDTK_TEST_FAULT``, see ``test_hook``) stop a rank at a chosen point so tests can
kill it there from outside; they act only when the variable is set.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from toolkit import errors

STOP_FILE_ENV = "MDTK_STOP_FILE"  # toolkit.launch.STOP_FILE_ENV, the same name
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingStopped(Exception):  # noqa: N818 - not an error: a requested stop
    """Raised on every rank after a requested stop; ``path``: the checkpoint saved for it
    (None when nothing new was trained since the last one)."""

    def __init__(self, step: int, path: str | None, reason: str):
        super().__init__(f"stopped at step {step} ({reason})")
        self.step, self.path, self.reason = step, path, reason


def stop_file(output_dir: str | Path) -> Path:
    """The file whose existence asks the run in ``output_dir`` to save and stop."""
    env = os.environ.get(STOP_FILE_ENV)
    return Path(env) if env else Path(output_dir) / "STOP"


def _write_stderr(text: str) -> None:
    os.write(2, text.encode())  # async-signal-safe, unlike print


class StopGuard:
    """Signal handlers and the stop file of one run (``with StopGuard(path):``).

    ``requested()`` is collective: call it on every rank at the same step boundary."""

    def __init__(self, path: Path):
        self.path = path
        self.reason: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None:  # asked twice: do not wait for the step boundary
            _write_stderr(f"[mdtk] {name} again: exiting now\n")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.reason = name
        _write_stderr(f"[mdtk] {name}: saving a checkpoint and stopping at the next step "
                      "boundary\n")

    def local(self) -> str | None:
        """This rank's reason to stop, if any (a signal, or the stop file exists)."""
        if self.reason is None and self.path.exists():
            self.reason = f"stop file {self.path}"
        return self.reason

    def requested(self) -> bool:
        """Whether any rank asks to stop (one all-reduce over every rank); afterwards
        ``reason`` says which rank asked and why, on every rank."""
        import torch
        import torch.distributed as dist

        from toolkit import runtime

        mine = self.local()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine is not None
        rank = dist.get_rank()
        code = 0 if mine is None else _REASONS.index(mine) if mine in _REASONS else 1
        flag = torch.tensor([code * _RANKS + rank if code else 0], dtype=torch.int64,
                            device=runtime.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        asked, by = divmod(value, _RANKS)
        if asked == 1:  # the stop file: a shared path every rank may see
            self.reason = mine if code == 1 else "stop file"
        elif asked:
            self.reason = f"{_REASONS[asked]} on rank {by}"
        return bool(value)


#: Reasons as all-reduced codes (a higher code wins): 1 is the stop file (its path is local).
_REASONS = ("", "", "SIGUSR1", "SIGTERM")
_RANKS = 1 << 24


class Heartbeat:
    """``with Heartbeat(timeout_s, rank):`` and ``beat(step)`` after each completed step;
    ``timeout_s <= 0`` turns the watchdog off."""

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank = float(timeout_s), rank
        self._last = time.monotonic()
        self._step: int | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        if self.timeout_s > 0:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="mdtk-heartbeat",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self, step: int) -> None:
        self._step, self._last = step, time.monotonic()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._done.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                since = "the start" if self._step is None else f"step {self._step}"
                _write_stderr(
                    f"[mdtk] rank {self.rank}: no training progress for {idle:.1f} s since "
                    f"{since} (runtime.heartbeat_timeout_s={self.timeout_s:g}): a rank is "
                    "hung, e.g. in a collective whose peer stalled or died. Exiting with "
                    f"status {errors.EXIT_HUNG} so the launcher restarts or ends the group.\n")
                sys.stdout.flush()
                os._exit(errors.EXIT_HUNG)


# -- test hooks --------------------------------------------------------------------------------
TEST_FAULT_ENV = "MDTK_TEST_FAULT"  # "KIND:POINT:RANK:STEP[:ATTEMPT],..." (attempt default 0)
TEST_FAULT_DIR_ENV = "MDTK_TEST_FAULT_DIR"  # where a hooked rank writes its pid (test_hook)


def test_hook(point: str, step: int, guard: StopGuard | None = None) -> None:
    """Stop this rank at ``point`` ("step": before step ``step``; "save": inside the save of
    ``step``, after the engine files are written, before publication) when MDTK_TEST_FAULT
    names it for this rank and torchrun restart attempt. Kinds: ``pause`` (wait until a stop
    is requested, then go on; 120 s at most), ``hang`` (sleep forever; a signal kills it).
    The rank first writes its pid to ``MDTK_TEST_FAULT_DIR``, in a file named
    ``<kind>-<point>-r<rank>-s<step>-a<attempt>``."""
    spec = os.environ.get(TEST_FAULT_ENV)
    if not spec:
        return
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for item in spec.split(","):
        kind, where, r, s, *a = item.split(":")
        if (where, int(r), int(s), int(a[0]) if a else 0) != (point, rank, step, attempt):
            continue
        name = f"{kind}-{point}-r{rank}-s{step}-a{attempt}"
        marker = Path(os.environ.get(TEST_FAULT_DIR_ENV, ".")) / name
        marker.write_text(str(os.getpid()))
        _write_stderr(f"[mdtk test] rank {rank}: {kind} at {point} {step} (pid {os.getpid()})\n")
        if kind == "hang":
            for sig in _SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            while True:
                time.sleep(1)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (guard is None or guard.local() is None):
            time.sleep(0.05)
