"""What the tests run on rank pools, torchrun ranks and subprocesses (tests/conftest.py puts
tests/ on the path), and ``load_script`` for the tests of scripts/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name``, once per process. scripts/ is not a
    package and its scripts import one another, so it goes on the path (last: it shadows
    nothing)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up while it is built
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_BACKGROUND = None


def background(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` started in a thread of this pytest process; its future. A
    module's jobs in several rank pools run at once this way (``.result()`` where a test needs
    them), and the tests that compute their references in this process (TRL, transformers) run
    meanwhile: one gloo job keeps this 2-core machine only ~60 % busy."""
    global _BACKGROUND
    if _BACKGROUND is None:
        from concurrent.futures import ThreadPoolExecutor

        _BACKGROUND = ThreadPoolExecutor(4, thread_name_prefix="pool_jobs")
    return _BACKGROUND.submit(fn, *args, **kwargs)


def own_cache(assets: dict[str, str], tag: str = "own") -> dict[str, str]:
    """``assets`` with a data cache of its own, for a job that runs beside another pool's: each
    pool's rank 0 writes Megatron's dataset index files there (the same contents, but not
    written atomically). The tokenised data and the losses are the same."""
    return {**assets, "cache": f"{assets['cache']}_{tag}"}
