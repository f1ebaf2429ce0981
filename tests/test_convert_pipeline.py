"""The converter's read-ahead (reads overlap writes, two tensors in memory) and --workers auto."""

from __future__ import annotations

import os
import threading
import time

import pytest

from toolkit.checkpoint.pipeline import read_ahead
from toolkit.convert.run import resolve_workers


def test_read_ahead_order_and_bound():
    """Items come back in order, produced ahead in a thread, with at most depth + 1 alive."""
    lock = threading.Lock()
    alive, peak, threads = 0, 0, set()

    def produce(i: int) -> int:
        nonlocal alive, peak
        with lock:
            alive += 1
            peak = max(peak, alive)
        threads.add(threading.current_thread().name)
        return i * i

    got = []
    for i, v in read_ahead(range(20), produce):
        time.sleep(0.005)  # a slow writer: the reader runs ahead as far as it may
        got.append((i, v))
        with lock:
            alive -= 1
    assert got == [(i, i * i) for i in range(20)]
    assert peak == 2
    assert threads == {"mdtk-read-ahead"}


def test_read_ahead_error_and_early_close():
    """A failing read raises at its item; leaving the loop early stops the thread."""
    def produce(i: int) -> int:
        if i == 3:
            raise OSError("disk gone")
        return i

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for i, _ in read_ahead(range(10), produce):
            seen.append(i)
    assert seen == [0, 1, 2]

    before = threading.active_count()
    gen = read_ahead(range(1000), lambda i: i)
    assert next(gen) == (0, 0)
    gen.close()
    assert threading.active_count() == before


def test_workers_auto():
    assert resolve_workers("auto") == max(1, (os.cpu_count() or 1) // 2)
    assert resolve_workers("3") == 3 and resolve_workers(2) == 2
    for bad in (0, "0", "many"):
        with pytest.raises(ValueError, match="--workers"):
            resolve_workers(bad)
