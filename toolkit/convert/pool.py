"""Jobs balanced by bytes, run in this process or in a pool of worker processes.

Jobs read the source of their process (``job_source``): in this process the one ``convert``
opened (``sharing``), reporting progress as they go instead of per job; in a worker the one it
opened when it started, from the picklable ``Ctx`` with the model's ``ModelSpec`` (so a worker
reads no config.json and builds the mapping once, whatever number of jobs it runs).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

from toolkit.convert.sources import Ctx, Opened, open_ctx

#: The source the jobs of this process read (``sharing`` / a worker's ``_open_worker``).
_SOURCE: list[Opened] = []


@contextlib.contextmanager
def sharing(op: Opened) -> Iterator[None]:
    """Jobs run in this process read ``op`` while the block runs."""
    _SOURCE.append(op)
    try:
        yield
    finally:
        _SOURCE.remove(op)


def job_source() -> Opened:
    """The source of this process's jobs."""
    return _SOURCE[-1]


def _open_worker(ctx: Ctx) -> None:
    """A worker's start: open the source once for all its jobs (closed when it exits)."""
    op = open_ctx(ctx)
    _SOURCE.append(op)
    atexit.register(op.source.close)


def split(items: list[Any], weights: list[int], n: int) -> list[list[Any]]:
    """Greedy balance by weight into at most n non-empty groups (order kept inside a group)."""
    groups: list[list[Any]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(items)), key=lambda i: -weights[i]):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += weights[i]
    return [[items[i] for i in sorted(g)] for g in groups if g]


def run_jobs(fn: Callable, jobs: list[tuple], workers: int, tick: Callable[[int], None],
             sizes: list[int], ctx: Ctx) -> list[Any]:
    """Run ``fn(*job)`` for each job, in this process (fine-grained progress) or in workers
    that each open the source of ``ctx`` once."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(*job, tick) for job in jobs]
    results: list[Any] = [None] * len(jobs)
    with cf.ProcessPoolExecutor(max_workers=workers,
                                mp_context=multiprocessing.get_context("spawn"),
                                initializer=_open_worker, initargs=(ctx,)) as pool:
        futures = {pool.submit(fn, *job): i for i, job in enumerate(jobs)}
        for fut in cf.as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            tick(sizes[i])
    return results
