"""The rank pools' own plumbing (toolkit/runtime/rankpool.py), on what the suite relies on."""

from __future__ import annotations

import os
import sys
import threading

from toolkit.runtime import rankpool


def test_pools_starting_in_threads_leave_this_process_environment_as_it_was(monkeypatch):
    """Pools start in threads (a module's queued jobs), and each start swaps os.environ to the
    ranks' variables while the fork server starts. Interleaved swaps once left
    OMP_NUM_THREADS=1 and PYTHONPATH=<checkout> in the pytest process for good: every later
    subprocess ran on one thread, and pip, seeing the checkout's mdtk.egg-info, skipped the
    wheel test's install. Threads switch every microsecond here so that the swaps interleave
    (without the lock, the first round already leaks)."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    before = dict(os.environ)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(10):
            barrier = threading.Barrier(4)

            threads = [threading.Thread(target=_start, args=(barrier,)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            leaked = {k: os.environ.get(k) for k in set(os.environ) ^ set(before)}
            assert dict(os.environ) == before, leaked
    finally:
        sys.setswitchinterval(interval)


def _start(barrier: threading.Barrier) -> None:
    barrier.wait()
    rankpool.start_preload_server()
