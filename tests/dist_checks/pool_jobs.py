"""What every rank-pool job runs around the test's function (tests/conftest.py)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any


def run_then_release(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, then its process groups destroyed and collected: a gloo group
    keeps a thread that wakes 100 times a second until its last reference goes, and engines
    hold theirs in reference cycles that an idle rank never collects (280 -> 200 threads per
    rank after two engine jobs; each job adds ~130)."""
    try:
        return fn(*args, **kwargs)
    finally:
        from toolkit.parallel import state

        state.destroy()
        gc.collect()
