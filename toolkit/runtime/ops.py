"""Build DeepSpeed's JIT-compiled CPU ops once, in one process, before any rank needs them.

DeepSpeed compiles CPU Adam (optimizer offload) and async_io (NVMe offload) on first use. When
several ranks hit that at once they queue on a lock file, on a 2-core machine the build takes
minutes, and a build killed half-way leaves a lock that makes every later build wait forever.
``make install`` therefore starts both builds in the background, CPU Adam first (2 files, ~55
CPU-seconds), then async_io at low priority (12 files and DeepSpeed's pin_memory op, ~180
CPU-seconds through scripts/pch_cxx.py), so that the tests or the demo start at once; whoever
needs an op first waits for its build (``prebuild``, or torch's build lock for a rank that loads
it; ``build_under_way``) instead of building it again.
Later loads are cached in ``TORCH_EXTENSIONS_DIR`` and take about a second. On CUDA, the ops
DeepSpeed builds for the GPU (ZeRO++'s quantizer, ...) need a ``TORCH_CUDA_ARCH_LIST`` that
DeepSpeed can parse: ``prepare_cuda_arch_list`` (called by ``runtime.prepare_deepspeed``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import time
from pathlib import Path

#: ``X.Y``, ``X.Y+PTX`` and torch's arch-specific ``X.Ya`` / ``X.Yf`` (e.g. ``9.0a``, ``10.0f``).
_ARCH = re.compile(r"(\d+)\.(\d+)[a-z]?(\+PTX)?")
_arch_logged = False
STALE_LOCK_S = 20 * 60  # no build of these ops takes this long on 2 cores, unless starved
OPS = ("cpu_adam", "async_io")


def extensions_dir() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


@contextlib.contextmanager
def _exclusive(path: Path, wait: bool = True):
    """An exclusive kernel lock on ``path``: held while the block runs, released by the kernel
    if this process dies (unlike torch's build lock, a file that outlives a killed build).
    ``wait=False``: ``BlockingIOError`` at once if another process holds it."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _alive(marker: Path) -> bool:
    try:
        os.kill(int(marker.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def clear_stale_lock(root: Path, name: str, max_age_s: float = STALE_LOCK_S) -> Path | None:
    """Remove ``name``'s torch build lock if no build holds it; call with ``name``'s kernel lock
    held. Every build started here writes its pid to ``<name>.building`` and removes it when
    done, so one left behind by a process that is gone means its builder died mid-build; a lock
    without one (a build started outside ``prebuild``) counts as stale after ``max_age_s``."""
    lock, marker = root / name / "lock", root / f"{name}.building"
    if not lock.exists():
        marker.unlink(missing_ok=True)
        return None
    if marker.exists():
        stale = not _alive(marker)
    else:
        stale = time.time() - lock.stat().st_mtime > max_age_s
    if stale:
        lock.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)
        return lock
    return None


def build_under_way(name: str) -> bool:
    """Whether another process holds ``name``'s build lock (``make install``'s background build,
    or a caller waiting for it). A rank that needs the op then waits for that build on torch's
    own build lock instead of starting a second one."""
    path = extensions_dir() / f"{name}.flock"
    if not path.exists():
        return False
    try:
        with _exclusive(path, wait=False):
            return False
    except BlockingIOError:
        return True


def prebuild(ops: tuple[str, ...] | list[str] = OPS, log=print) -> dict[str, str]:
    """Load (building if needed, or waiting for a build under way) the named ops: "cpu_adam"
    and "async_io" (needs libaio).

    Builds of one op run one at a time under a kernel lock (``<op>.flock``), so a caller waits
    for a build under way and a build killed half-way never blocks the next.
    Returns op name -> "ok" or the reason it is unavailable; never raises for a missing op,
    since only offload configurations need them.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    from toolkit.runtime import cpu_compat

    cpu_compat.cache_cpu_info()

    root = extensions_dir()
    builders = {"cpu_adam": CPUAdamBuilder, "async_io": AsyncIOBuilder}
    status = {}
    for name in ops:
        b = builders[name]()
        if not b.is_compatible(verbose=False):
            status[b.NAME] = "not buildable here (see `mdtk env`)"
            continue
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root / f"{b.NAME}.flock"):
            status[b.NAME] = _load(b, root, log)
    return status


def _load(b, root: Path, log) -> str:
    stale = clear_stale_lock(root, b.NAME)
    if stale is not None:
        log(f"removed stale build lock {stale}")
    cached = (root / b.NAME / f"{b.NAME}.so").exists()
    if not cached:
        log(f"building DeepSpeed op {b.NAME} (once; a few minutes on 2 cores)...")
    start = time.perf_counter()
    marker = root / f"{b.NAME}.building"
    try:
        marker.write_text(str(os.getpid()))
        b.load(verbose=False)
    except Exception as e:  # noqa: BLE001 - report, do not stop the install
        return f"build failed: {e}"
    finally:
        marker.unlink(missing_ok=True)
    if not cached:
        log(f"built {b.NAME} in {time.perf_counter() - start:.0f} s")
    return "ok"


def normalize_arch_list(value: str) -> tuple[str, list[str]]:
    """``TORCH_CUDA_ARCH_LIST`` in the form DeepSpeed 0.19.8's JIT builder parses, and the entries
    it had to drop.

    DeepSpeed sorts the entries by ``int()`` of each dot-separated part (builder.py,
    ``compute_capability_args``), so torch's arch-specific suffixes ("9.0a", "10.0f": features
    of one GPU generation that DeepSpeed's kernels do not use) crash every CUDA op build with
    ``ValueError: invalid literal for int() with base 10: '0a'``. Each becomes its plain arch
    ("9.0a" -> "9.0", "9.0a+PTX" -> "9.0+PTX"); duplicates go; separators are ``;`` or spaces.
    Entries that are no arch at all (named arches such as "Hopper") are dropped and returned.
    """
    kept: list[str] = []
    dropped: list[str] = []
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        m = _ARCH.fullmatch(entry)
        if m is None:
            dropped.append(entry)
            continue
        cc = f"{int(m.group(1))}.{int(m.group(2))}{m.group(3) or ''}"
        if cc not in kept:
            kept.append(cc)
    return ";".join(kept), dropped


def device_arch_list() -> str:
    """The compute capabilities of this machine's visible GPUs, e.g. "9.0"."""
    import torch

    ccs = []
    for i in range(torch.cuda.device_count()):
        cc = "{}.{}".format(*torch.cuda.get_device_capability(i))
        if cc not in ccs:
            ccs.append(cc)
    return ";".join(ccs)


def prepare_cuda_arch_list(log=print) -> str | None:
    """Make ``TORCH_CUDA_ARCH_LIST`` one that DeepSpeed's CUDA op builds (quantizer for ZeRO++,
    fused Adam, ...) can parse, before any of them is loaded; said once per process when changed.

    Set: normalised (``normalize_arch_list``). Unset, or nothing usable in it: this machine's
    GPUs (what DeepSpeed would probe itself, except in a forked process where it cannot).
    Returns the list in effect, or None without CUDA (the CPU ops ignore the variable).
    """
    global _arch_logged
    from toolkit import runtime

    if not runtime.use_cuda():
        return None
    raw = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    fixed, dropped = normalize_arch_list(raw)
    source = "normalised for DeepSpeed's op builder"
    if not fixed:
        fixed, source = device_arch_list(), "this machine's GPUs"
    if fixed and fixed != raw:
        os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
        if not _arch_logged:
            _arch_logged = True
            log(f"TORCH_CUDA_ARCH_LIST {raw or '(unset)'!r} -> {fixed!r} ({source}"
                + (f"; dropped {dropped}" if dropped else "") + ")")
    return fixed or None


def quantizer_missing() -> str | None:
    """Why DeepSpeed's quantizer kernels (ZeRO++ qwZ/qgZ: int8 weight gathers, int4 gradient
    all-to-alls) cannot run on this machine, or None when they can (built or buildable)."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder import QuantizerBuilder

        builder = QuantizerBuilder()
        accelerator = get_accelerator().device_name()
        if type(builder).__name__ == "NotImplementedBuilder":
            return (f"DeepSpeed's {accelerator} accelerator has no quantizer op (DeepSpeed raises "
                    "'ValueError: This op had not been implemented on CPU backend.')")
        if not builder.is_compatible(verbose=False):
            return (f"DeepSpeed's quantizer op cannot be built on this {accelerator} machine "
                    "(CUDA toolkit or torch version; see `mdtk env`)")
    except Exception as e:  # noqa: BLE001 - any failure means the kernels are not usable here
        return f"DeepSpeed's quantizer op is not usable here ({type(e).__name__}: {e})"
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m toolkit.runtime.ops [OP ...]``: build the named ops (default: all)."""
    names = (argv if argv is not None else sys.argv[1:]) or list(OPS)
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        print(f"unknown op(s) {unknown}: choose from {list(OPS)}", file=sys.stderr)
        return 2
    status = prebuild(names)
    for name, s in status.items():
        print(f"DeepSpeed op {name}: {s}")
    return 0 if all(s == "ok" for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

