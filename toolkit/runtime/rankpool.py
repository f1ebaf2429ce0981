"""Run functions on N real gloo ranks in spawned processes, reusing the processes between calls.

Starting a process that imports megatron-core and DeepSpeed costs seconds, so a pool of ranks is
started once and many checks run on it. A failure on any rank is raised in the caller with that
rank's traceback; a hang ends at the timeout with the ranks that did not answer named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from toolkit.runtime.ports import free_port


class RankFailure(RuntimeError):
    """A function raised on one or more ranks; the message holds their tracebacks."""


def _worker(rank: int, world_size: int, port: int, tasks, results, env: dict[str, str],
            start_method: str | None = None) -> None:
    os.environ.update(env)
    if start_method is not None:  # a forked rank's, as a spawned one has it (the parent's)
        mp.set_start_method(start_method, force=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch

        torch.set_num_threads(1)
        from toolkit import runtime

        runtime.enable_cpu_mode()
        runtime.init_distributed(timeout_s=int(env.get("MDTK_TEST_DIST_TIMEOUT", "300")))
        results.put((rank, "ready", None))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        results.put((rank, "error", traceback.format_exc()))
        os._exit(1)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = pickle.loads(task)
        try:
            payload = pickle.dumps(fn(*args, **kwargs))
            _release_groups()
            results.put((rank, "ok", payload))
        except BaseException:  # noqa: BLE001
            results.put((rank, "error", traceback.format_exc()))
    # Exiting through the interpreter sometimes aborts in gloo/DeepSpeed teardown
    # ("terminate called without an active exception"); the work is done, so leave at once.
    os._exit(0)


def _release_groups() -> None:
    """Drop any process groups a job left behind, so later jobs do not inherit its threads."""
    import sys

    state = sys.modules.get("toolkit.parallel.state")
    if state is not None:
        state.destroy()


#: What every rank's environment has (``RankPool(env=...)`` adds to it).
RANK_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MDTK_DEVICE": "cpu",
            "TOKENIZERS_PARALLELISM": "false"}
PRELOAD_MODULE = "toolkit.runtime.rank_preload"
# Pools start in threads (a caller's queued jobs); starting the fork server swaps os.environ, and
# two swaps that interleave leave the ranks' variables (OMP_NUM_THREADS=1, PYTHONPATH) in this
# process for good: every swap, and every read of the environment for a rank, holds this lock.
_ENV_LOCK = threading.Lock()


def start_preload_server() -> bool:
    """Start (once per process) the fork server that ``RankPool(preload=True)`` forks its ranks
    from: it imports ``toolkit.runtime.rank_preload`` with the ranks' environment while the
    caller goes on, so the first pool finds it loaded. False (nothing started) where CUDA is
    available: ranks are spawned there."""
    from multiprocessing import forkserver

    import torch

    if torch.cuda.is_available():
        return False
    mp.get_context("forkserver").set_forkserver_preload([PRELOAD_MODULE])
    # the server's environment is this process's when it starts (its imports read it)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with _ENV_LOCK:
        path = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        extra = {**RANK_ENV, "PYTHONPATH": os.pathsep.join(path)}
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return True


class RankPool:
    """``with RankPool(2) as pool: results = pool.run(fn, arg)`` runs ``fn(arg)`` on 2 ranks.

    ``preload=True``: the ranks are forked from one server process that imported torch,
    DeepSpeed, megatron-core and transformers once (``start_preload_server``) instead of each
    importing them (~6 CPU-s per rank); each rank gets this process's environment as a spawned
    one would. Where CUDA is available ranks are spawned as without it."""

    def __init__(self, world_size: int, *, start_timeout: float = 180.0,
                 env: dict[str, str] | None = None, preload: bool = False):
        self.world_size = world_size
        self.start_timeout = start_timeout
        self.env = {**RANK_ENV, **(env or {})}
        self.preload = preload
        self._procs: list[mp.Process] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self.broken = False

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        env, method = self.env, None
        if self.preload and start_preload_server():
            ctx = mp.get_context("forkserver")
            with _ENV_LOCK:
                env = {**os.environ, **self.env}  # as a spawn would inherit it now
            method = mp.get_start_method()
        else:
            ctx = mp.get_context("spawn")
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        for rank in range(self.world_size):
            p = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self._tasks[rank], self._results, env,
                      method),
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        self._collect("start-up", self.start_timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        if self.broken:
            raise RuntimeError("this RankPool failed earlier; start a new one")
        task = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put(task)
        payloads = self._collect(getattr(fn, "__qualname__", str(fn)), timeout)
        return [pickle.loads(p) for p in payloads]

    def _collect(self, what: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[str, Any]] = {}
        first_error_at: float | None = None
        while len(got) < self.world_size:
            now = time.monotonic()
            # After one rank fails, the others are often stuck in a collective: wait briefly.
            limit = deadline if first_error_at is None else min(deadline, first_error_at + 10.0)
            if now >= limit:
                break
            try:
                rank, status, payload = self._results.get(timeout=min(1.0, limit - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                if dead and first_error_at is None:
                    first_error_at = time.monotonic()
                    for r in dead:
                        got[r] = ("error", f"rank {r} process died (exit code "
                                           f"{self._procs[r].exitcode})")
                continue
            got[rank] = (status, payload)
            if status == "error" and first_error_at is None:
                first_error_at = time.monotonic()
        errors = {r: p for r, (s, p) in got.items() if s == "error"}
        missing = [r for r in range(self.world_size) if r not in got]
        if errors or missing:
            self.broken = True
            self.close(force=True)
            lines = [f"{what} failed on {self.world_size} ranks"]
            for r, tb in sorted(errors.items()):
                lines.append(f"--- rank {r} ---\n{tb}")
            if missing:
                lines.append(f"ranks {missing} did not answer within {timeout:.0f} s "
                             "(hung in a collective or too slow)")
            raise RankFailure("\n".join(lines))
        return [got[r][1] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                try:
                    q.put(None)
                except (ValueError, OSError):
                    pass
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
