"""Shared fixtures: pools of real gloo ranks, started once per session and reused."""

from __future__ import annotations

import functools
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # makes tests/dist_checks importable

from dist_checks import load_script, pool_jobs  # noqa: E402

# DeepSpeed's ops built as `make install` builds them (same cache, same compiler wrapper), so a
# bare pytest reuses that build instead of compiling them again
load_script("pch_cxx").use_in(os.environ)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from toolkit.runtime.rankpool import RankPool  # noqa: E402

_OPS_READY = False
_OPS_LOCK = threading.Lock()


def _prebuild_ops() -> None:
    """CPU Adam built once before ranks need it, by this process, unless `make install`'s
    background build has it: then the ranks that need it wait for that build (on torch's build
    lock) while the tests before them run."""
    global _OPS_READY
    with _OPS_LOCK:  # pools' jobs start from their own threads
        if _OPS_READY:
            return
        from toolkit.runtime import ops

        if not ops.build_under_way("cpu_adam"):
            ops.prebuild(["cpu_adam"])
        _OPS_READY = True


_GROUP: dict[str, int] = {}  # test id -> 0, 1 (nvme) or 2 (late)
_OPEN: list[_LazyPool] = []  # the session's rank pools


def pytest_collection_modifyitems(config, items):
    """Tests marked ``nvme`` run after the others: `make install` builds DeepSpeed's async_io
    op in the background (about a minute of CPU with scripts/pch_cxx.py), and the suite runs
    meanwhile instead of waiting for it; they still find the rank pools warm. Tests marked
    ``late`` (many process starts under time limits) run last, once that build is surely done:
    on a fresh CI clone the two-agent launch took 158 s beside the build, 57 s after it."""
    def order(item) -> int:
        if item.get_closest_marker("late") is not None:
            return 2
        return 1 if item.get_closest_marker("nvme") is not None else 0

    _GROUP.update((item.nodeid, order(item)) for item in items)
    items.sort(key=order)  # stable: file order within each group


def pytest_runtest_teardown(item, nextitem):
    """The rank pools close before the ``late`` tests: idle ranks are not free (every gloo
    group a job made keeps a thread that wakes 100 times a second until it is collected), and
    the launches need the CPU."""
    if nextitem is not None and _GROUP.get(item.nodeid, 0) < 2 <= _GROUP.get(nextitem.nodeid, 0):
        for pool in _OPEN:
            pool.close()


def pytest_collection_finish(session):
    """The rank pools' ranks are forked from one process that imported torch, megatron-core,
    DeepSpeed and transformers once (``RankPool(preload=True)``; 7 ranks in the suite, each
    ~6 CPU-s of imports otherwise): it starts now, when a collected test needs a pool, and
    loads while the first tests run."""
    if any(name.startswith("rank_pool_") for item in session.items
           for name in item.fixturenames):
        from toolkit.runtime.rankpool import start_preload_server

        start_preload_server()


@pytest.fixture(scope="session")
def async_io_ready() -> str | None:
    """Wait for (or do) the async_io build; None when ready, else why NVMe cannot be tested."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from toolkit.runtime import ops

    if not AsyncIOBuilder().is_compatible(verbose=False):
        return ("DeepSpeed's async_io op cannot build here (libaio-dev missing: "
                "`apt-get install libaio-dev`, done by `make install`); NVMe offload not tested")
    status = ops.prebuild(["async_io"])["async_io"]
    return None if status == "ok" else f"DeepSpeed's async_io op: {status}"


class _LazyPool:
    """Starts the ranks on first use and restarts them after a failure, so one failing
    check does not take the rest of the session's distributed checks with it.

    ``submit`` queues a job and returns its future: a module's single-rank references run
    while its 2- or 4-rank layouts run in another pool (a gloo job of 2 ranks keeps this 2-core
    machine ~60 % busy: its ranks wait on each other). One job at a time per pool, in order."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.pool: RankPool | None = None
        self.jobs = ThreadPoolExecutor(1, thread_name_prefix=f"rank_pool_{world_size}")
        _OPEN.append(self)

    def submit(self, fn, *args, timeout: float = 300.0, **kwargs) -> Future:
        return self.jobs.submit(self._run, fn, *args, timeout=timeout, **kwargs)

    def run(self, fn, *args, timeout: float = 300.0, **kwargs):
        return self.submit(fn, *args, timeout=timeout, **kwargs).result()

    def _run(self, fn, *args, timeout: float = 300.0, **kwargs):
        _prebuild_ops()
        if self.pool is None or self.pool.broken:
            self.pool = RankPool(self.world_size, preload=True)
            self.pool.start()
        job = functools.partial(pool_jobs.run_then_release, fn)  # its name says fn's too
        return self.pool.run(job, *args, timeout=timeout, **kwargs)

    def close(self):
        self.jobs.submit(lambda: None).result()  # after the queued jobs
        if self.pool is not None and not self.pool.broken:
            self.pool.close()
        self.pool = None  # the next run starts a fresh pool


@pytest.fixture(scope="session")
def rank_pool_1():
    """One rank (world size 1) for the single-rank references of every file: one process
    start for the session instead of one per file (each start imports torch, megatron-core,
    DeepSpeed and transformers again: ~4.5 s)."""
    pool = _LazyPool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def rank_pool_2():
    pool = _LazyPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def rank_pool_4():
    pool = _LazyPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Tiny random-weight HF checkpoints of every adapter family (+ their HF logits), built
    once per session in this process (without mdtk's CPU mode). Tests only add subfolders."""
    from dist_checks import adapter_checks

    root = tmp_path_factory.mktemp("tiny_hf")
    adapter_checks.build_checkpoints(root)
    return root


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    """The demo's tiny Llama (bundled:examples/tiny_llama_config.json, random weights, with its
    tokenizer), built once per session as `mdtk demo` builds it. Tests only read it."""
    from toolkit.demo import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("demo") / "tiny-llama")


@pytest.fixture(scope="session")
def trainer_models(tmp_path_factory) -> dict[str, str]:
    """``trainer_checks.make_assets`` (a tiny tokenizer and the trainer tests' tiny HF
    checkpoints), built once per session: tests only read them. Use ``trainer_assets``."""
    from dist_checks import trainer_checks

    return trainer_checks.make_assets(tmp_path_factory.mktemp("trainer_models"))


@pytest.fixture(scope="module")
def trainer_assets(trainer_models, tmp_path_factory) -> tuple[dict[str, str], Path]:
    """The shared tiny models with this module's own data cache, and a folder for its runs."""
    root = tmp_path_factory.mktemp("trainer_runs")
    return {**trainer_models, "cache": str(root / "data_cache")}, root

