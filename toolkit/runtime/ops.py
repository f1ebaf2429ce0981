"""Build DeepSpeed's JIT-compiled CPU ops once, in one process, before any rank needs them.

DeepSpeed compiles CPU Adam (optimizer offload) and async_io (NVMe offload) on first use. When
several ranks hit that at once they queue on a lock file, on a 2-core machine the build takes
minutes, and a build killed half-way leaves a lock that makes every later build wait forever.
``make install`` and the test session therefore build them here first; later loads are cached
in ``TORCH_EXTENSIONS_DIR`` and take about a second.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STALE_LOCK_S = 20 * 60  # no build of these ops takes this long, even on 2 cores


def extensions_dir() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def clear_stale_locks(root: Path | None = None, max_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove build locks older than ``max_age_s``: left by a killed build, they block forever."""
    root = root or extensions_dir()
    removed = []
    for lock in root.glob("*/lock") if root.is_dir() else ():
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed


def prebuild(nvme: bool = True, log=print) -> dict[str, str]:
    """Load (building if needed) CPU Adam and, when libaio is present, async_io.

    Returns op name -> "ok" or the reason it is unavailable; never raises for a missing op,
    since only offload configurations need them.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    for lock in clear_stale_locks():
        log(f"removed stale build lock {lock}")
    builders = [CPUAdamBuilder()] + ([AsyncIOBuilder()] if nvme else [])
    status = {}
    for b in builders:
        if not b.is_compatible(verbose=False):
            status[b.NAME] = "not buildable here (see `mdtk env`)"
            continue
        cached = (extensions_dir() / b.NAME / f"{b.NAME}.so").exists()
        if not cached:
            log(f"building DeepSpeed op {b.NAME} (once; a few minutes on 2 cores)...")
        start = time.perf_counter()
        try:
            b.load(verbose=False)
        except Exception as e:  # noqa: BLE001 - report, do not stop the install
            status[b.NAME] = f"build failed: {e}"
            continue
        status[b.NAME] = "ok"
        if not cached:
            log(f"built {b.NAME} in {time.perf_counter() - start:.0f} s")
    return status


def main() -> int:
    status = prebuild()
    for name, s in status.items():
        print(f"DeepSpeed op {name}: {s}")
    return 0 if status.get("cpu_adam") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
