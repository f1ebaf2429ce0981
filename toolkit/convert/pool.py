"""Jobs balanced by bytes, run in this process or in a pool of worker processes.

A worker reopens the source from the picklable ``Ctx``; jobs that run in this process reuse the
source ``convert`` opened (``sharing``), and report progress as they go instead of per job.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

from toolkit.convert.sources import Ctx, Opened, open_ctx

#: The source opened by ``convert`` in this process (jobs run here reuse it).
_IN_PROCESS: dict[Ctx, Opened] = {}


@contextlib.contextmanager
def sharing(ctx: Ctx, op: Opened) -> Iterator[None]:
    """Jobs of ``ctx`` run in this process use ``op`` while the block runs."""
    _IN_PROCESS[ctx] = op
    try:
        yield
    finally:
        _IN_PROCESS.pop(ctx, None)


@contextlib.contextmanager
def job_source(ctx: Ctx) -> Iterator[Opened]:
    """The source of a job: the shared one in this process, else opened (and closed) here."""
    if ctx in _IN_PROCESS:
        yield _IN_PROCESS[ctx]
        return
    op = open_ctx(ctx)
    try:
        yield op
    finally:
        op.source.close()


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
             sizes: list[int]) -> list[Any]:
    """Run ``fn(*job)`` for each job, in this process (fine-grained progress) or in workers."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(*job, tick) for job in jobs]
    results: list[Any] = [None] * len(jobs)
    with cf.ProcessPoolExecutor(max_workers=workers,
                                mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(fn, *job): i for i, job in enumerate(jobs)}
        for fut in cf.as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            tick(sizes[i])
    return results
