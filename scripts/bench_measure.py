"""What the benchmarks share: a command's wall time, CPU seconds and peak RSS, folder sizes, the
page-cache state before a timed step (the converter benchmarks), the median / spread of repeated
rounds, and a result printed and written as JSON (``report``)."""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

MDTK = str(Path(sys.executable).parent / "mdtk")


def largest_tensor_bytes(path: Path) -> int:
    from toolkit.checkpoint.hf import HFReader

    with HFReader(path) as r:
        return max(math.prod(r.shape(n)) * r.dtype(n).itemsize for n in r.names)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(cmd: list[str], env: dict[str, str] | None = None, keep_output: bool = False) -> dict:
    """Wall time, user / kernel CPU seconds and peak RSS (summed over the process tree) of one
    command (and its output, with ``keep_output``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                rss = 0
                for p in procs:
                    try:
                        rss += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak = max(peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = proc.communicate()
    seconds = time.perf_counter() - t0
    done.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out_ = {"seconds": seconds, "peak_rss": peak, "user": after.ru_utime - before.ru_utime,
            "kernel": after.ru_stime - before.ru_stime}
    return {**out_, "output": out} if keep_output else out_


def settle(cold: str, source: Path) -> None:
    """Before every timed step (untimed): write back dirty pages, so no step pays for the
    previous one's writeback; ``cold="all"`` also drops the whole page cache (root only),
    ``cold="source"`` the cached pages of the files under ``source`` only."""
    subprocess.run(["sync"], check=True)
    if cold == "all":
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    elif cold == "source":
        for p in source.rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def fmt(st: dict) -> str:
    return f"{st['median']:6.2f} s (min {st['min']:.2f}, max {st['max']:.2f})"


def report(result: dict, path: Path | None) -> None:
    """``result`` printed as JSON, and written to ``path`` too when given (the GPU check reads
    it there)."""
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        path.write_text(text)
