"""CPU seconds of the test suite, per test and per file, with every process the tests start.

    python scripts/suite_cpu.py --json build/suite-cpu.json [pytest arguments...]
    python scripts/suite_cpu.py --compare before.json after.json

Runs pytest in this process with a plugin that, around each test's setup, call and teardown,
reads the CPU time (user + system) of the whole process tree: this process, its reaped
children (getrusage) and every live descendant from /proc (its own time and that of the
children it reaped). Rank pools, torchrun workers and subprocesses are all counted, and their
time is charged to the test that was running when they used it. Every Python process started
under the run is counted too (a sitecustomize.py on PYTHONPATH appends one line per start).

Wall time on a shared machine moves with the other load; CPU seconds much less, which is why
this is the figure to compare (docs/benchmarks.md, "Test suite"). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_SITE = """import os, sys
_log = os.environ.get("MDTK_PROC_LOG")
if _log:
    with open(_log, "a") as f:
        f.write(f"{os.getpid()} {os.getppid()} {' '.join(sys.argv[:3])[:200]}\\n")
"""


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of it and of the children it reaped)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        # fields[1] = ppid; utime, stime, cutime, cstime = fields[11:15] (stat(5) 14-17)
        table[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / _TICK)
    return table


def tree_cpu() -> float:
    """CPU seconds used so far by this process and everything it started."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    table = _proc_table()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    stack = list(children[os.getpid()])
    while stack:
        pid = stack.pop()
        total += table[pid][1]
        stack.extend(children[pid])
    return total


class CpuPlugin:
    def __init__(self, proc_log: Path):
        self.proc_log = proc_log
        self.tests: dict[str, dict[str, float]] = {}
        self.outcomes: collections.Counter[str] = collections.Counter()

    def _starts(self) -> int:
        try:
            with open(self.proc_log) as f:
                return sum(1 for _ in f)
        except OSError:
            return 0

    def _measure(self, item, phase: str):
        cpu0, wall0, starts0 = tree_cpu(), time.monotonic(), self._starts()
        yield
        rec = self.tests.setdefault(item.nodeid, {"cpu": 0.0, "wall": 0.0, "starts": 0})
        rec["cpu"] += tree_cpu() - cpu0
        rec["wall"] += time.monotonic() - wall0
        rec["starts"] += self._starts() - starts0

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.outcome] += 1


def _hook(phase):
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def hook(self, item, *args):
        yield from self._measure(item, phase)

    return hook


def _install_hooks() -> None:
    for phase in ("setup", "call", "teardown"):
        setattr(CpuPlugin, f"pytest_runtest_{phase}", _hook(phase))


def by_file(tests: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    files: dict[str, dict[str, float]] = {}
    for nodeid, rec in tests.items():
        agg = files.setdefault(nodeid.split("::")[0], {"cpu": 0.0, "wall": 0.0, "starts": 0,
                                                        "tests": 0})
        for key in ("cpu", "wall", "starts"):
            agg[key] += rec[key]
        agg["tests"] += 1
    return dict(sorted(files.items(), key=lambda kv: -kv[1]["cpu"]))


def run(out: Path, pytest_args: list[str]) -> int:
    import pytest

    _install_hooks()
    site = Path(tempfile.mkdtemp(prefix="suite_cpu_"))
    (site / "sitecustomize.py").write_text(_SITE)
    proc_log = site / "starts.log"
    os.environ["MDTK_PROC_LOG"] = str(proc_log)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    plugin = CpuPlugin(proc_log)
    cpu0, wall0 = tree_cpu(), time.monotonic()
    status = pytest.main(pytest_args, plugins=[plugin])
    total = {"cpu": tree_cpu() - cpu0, "wall": time.monotonic() - wall0,
             "starts": plugin._starts(), "outcomes": dict(plugin.outcomes)}
    files = by_file(plugin.tests)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"total": total, "files": files, "tests": plugin.tests}, indent=1))
    print(f"\nCPU {total['cpu']:.0f} s, wall {total['wall']:.0f} s, "
          f"{total['starts']} Python processes started, {total['outcomes']}")
    print(f"{'cpu s':>7} {'wall s':>7} {'starts':>6} {'tests':>5}  file")
    for name, agg in files.items():
        print(f"{agg['cpu']:7.1f} {agg['wall']:7.1f} {agg['starts']:6d} {agg['tests']:5d}  {name}")
    return int(status)


def compare(before: Path, after: Path) -> None:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    for key in ("cpu", "wall", "starts"):
        x, y = a["total"][key], b["total"][key]
        print(f"{key:>6}: {x:8.0f} -> {y:8.0f}  ({y / x:.2f}x)")
    names = sorted(set(a["files"]) | set(b["files"]),
                   key=lambda n: -a["files"].get(n, {"cpu": 0})["cpu"])
    print(f"{'before':>7} {'after':>7} {'starts':>11}  file")
    for n in names:
        fa = a["files"].get(n, {"cpu": 0.0, "starts": 0})
        fb = b["files"].get(n, {"cpu": 0.0, "starts": 0})
        print(f"{fa['cpu']:7.1f} {fb['cpu']:7.1f} {fa['starts']:5d}->{fb['starts']:<5d}  {n}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("build/suite-cpu.json"),
                        help="where the per-test figures go (default build/suite-cpu.json)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="print two earlier runs side by side instead of running")
    args, pytest_args = parser.parse_known_args()
    if args.compare:
        compare(*args.compare)
        return 0
    return run(args.json, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
