"""`make install` on a fresh clone: the baseline commit's (pip, no lock) against this checkout's
with pip and with uv (both from requirements.lock), alternating, several rounds.

    python scripts/bench_install.py --baseline 4ea1b45 --rounds 2 [--cache cold|warm]
    python scripts/bench_install.py --packages --rounds 3   # only the step after torch

Each round clones the repository three times into a temporary folder (committed files only)
and times `make install` there. ``--cache cold`` gives every install empty pip and uv caches
(a new machine: every wheel but torch's is downloaded; torch comes from this machine's disk);
``warm`` gives each variant its own cache that persists across rounds (round 1 fills it; the
figures are the later rounds). DeepSpeed's ops are loaded from a pre-built copy, so the figures
are the package installation. Prints each time, the median and spread per variant, and ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("baseline", "pip", "uv")


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{done.stdout[-3000:]}"
                         f"{done.stderr[-3000:]}")


def _running_in(folder: Path) -> bool:
    """Whether a process still runs with ``folder`` as its working directory."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(proc / "cwd")) == folder:
                return True
        except OSError:
            continue
    return False


PACKAGES = {  # --packages: the step that differs, after torch (pip, from this machine's disk)
    "pip": "{py} -m pip install -q -c requirements.lock -e .[test]",
    "uv": "{py} -m pip install -q -c requirements.lock uv && .venv/bin/uv pip install -q "
          "--python {py} --compile-bytecode -c requirements.lock -e .[test]",
}


def packages(variant: str, tmp: Path, cache: Path) -> float:
    """A fresh clone and venv with torch; then only the timed install of everything else."""
    clone = tmp / f"clone-{variant}"
    shutil.rmtree(clone, ignore_errors=True)
    _run(["git", "clone", "-q", str(ROOT), str(clone)], tmp)
    env = {**os.environ, "PIP_CACHE_DIR": str(cache / "pip"), "UV_CACHE_DIR": str(cache / "uv")}
    _run([sys.executable, "-m", "venv", ".venv"], clone)
    _run([".venv/bin/python", "-m", "pip", "install", "-q", "-c", "requirements.lock",
          "torch==2.13.0"], clone, env)
    start = time.perf_counter()
    _run(["bash", "-c", PACKAGES[variant].format(py=".venv/bin/python")], clone, env)
    took = time.perf_counter() - start
    shutil.rmtree(clone, ignore_errors=True)
    return took


def install(variant: str, baseline: str, tmp: Path, ops: Path, cache: Path) -> float:
    clone = tmp / f"clone-{variant}"
    shutil.rmtree(clone, ignore_errors=True)
    _run(["git", "clone", "-q", str(ROOT), str(clone)], tmp)
    _run(["git", "checkout", "-q", baseline if variant == "baseline" else "HEAD"], clone)
    env = {**os.environ, "PIP_CACHE_DIR": str(cache / "pip"), "UV_CACHE_DIR": str(cache / "uv")}
    args = ["make", "install", f"TORCH_EXTENSIONS_DIR={ops}"]
    if variant != "baseline":
        args.append(f"INSTALLER={variant}")
    start = time.perf_counter()
    _run(args, clone, env)
    took = time.perf_counter() - start
    for _ in range(120):  # the background async_io load (pre-built: seconds) ends by itself
        if not _running_in(clone):
            break
        time.sleep(1)
    shutil.rmtree(clone, ignore_errors=True)
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="", help="the commit before the lock (pip, no lock)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cache", choices=("cold", "warm"), default="cold")
    p.add_argument("--ops", type=Path, default=ROOT / "build" / "torch_extensions",
                   help="built DeepSpeed ops to copy (cpu_adam, async_io)")
    p.add_argument("--packages", action="store_true",
                   help="time only the install after torch, pip against uv (no baseline)")
    a = p.parse_args()
    if not (a.packages or a.baseline):
        p.error("--baseline COMMIT is needed unless --packages")
    variants = tuple(PACKAGES) if a.packages else VARIANTS
    times: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench_install_") as t:
        tmp = Path(t)
        ops = tmp / "ops"
        for name in () if a.packages else ("cpu_adam", "async_io"):
            shutil.copytree(a.ops / name, ops / name, ignore=shutil.ignore_patterns("lock"))
        for r in range(a.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                cache = tmp / ("cache-" + v if a.cache == "warm" else f"cache-{v}-{r}")
                took = (packages(v, tmp, cache) if a.packages
                        else install(v, a.baseline, tmp, ops, cache))
                if a.cache == "cold":
                    shutil.rmtree(cache, ignore_errors=True)
                times[v].append(took)
                print(f"round {r + 1} {v:8s} {took:6.1f} s", flush=True)
    skip = 1 if a.cache == "warm" and a.rounds > 1 else 0  # round 1 only fills a warm cache
    med = {v: statistics.median(ts[skip:]) for v, ts in times.items()}
    print(f"\n{a.cache} caches, {a.rounds} rounds" + (" (round 1 not counted)" if skip else ""))
    for v, ts in times.items():
        vs_base = f"  vs baseline x{med[v] / med['baseline']:.2f}" if "baseline" in med else ""
        print(f"{v:8s} median {med[v]:6.1f} s  spread {min(ts[skip:]):.1f}-{max(ts[skip:]):.1f} s"
              f"{vs_base}  vs pip x{med[v] / med['pip']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
