"""requirements.lock, the tested versions: what the Makefile's install, lock and test-latest
targets do with it.

    python scripts/lockfile.py lock LOCK --uv UV --pin torch==2.13.0 [--upgrade]   # make lock
    python scripts/lockfile.py constraints LOCK OUT   # the pins `make install` installs with
    python scripts/lockfile.py check LOCK             # installed versions == the lock's
    python scripts/lockfile.py report LOCK JUNIT      # make test-latest: versions, failures

``lock`` runs ``uv pip compile`` on pyproject.toml's dependencies and its ``test`` and ``gpu``
extras (``gpu`` is locked but installed only on CUDA machines, by hand or the GPU check) (plus
uv itself, the installer), universal (markers where Python 3.10, 3.11 or 3.12 need different
versions), keeping the lock's versions where the ranges still allow them unless ``--upgrade``;
then it prints what changed. ``constraints`` copies the lock, except where the venv already
holds a torch of another version (a CUDA build installed on purpose, which `make install`
leaves alone): then torch and what only torch brings (triton, nvidia-*, cuda-*) are left out,
and ``check`` says so instead of failing. Run ``check`` and ``report`` with the venv's python
(they read its installed packages and evaluate markers with ``packaging``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

TORCH_ONLY = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
NOT_LOCKED = {"pip", "setuptools", "wheel", "mdtk"}  # the installers and the project itself
TOOLS = ("uv",)  # locked beside the project's dependencies: the installer `make install` uses
HEADER = """\
# requirements.lock: the exact versions mdtk is tested with (`make test`, CI), used as
# constraints by `make install` / `make demo` / `make test` / .ci/run. Tested on Python 3.11;
# lines with python_full_version markers pin what Python 3.10 or 3.12+ need instead.
# Regenerate with `make lock` (keeps these versions where pyproject.toml's ranges still allow
# them; prints old -> new) or `make lock UPGRADE=1` (the newest the ranges allow), which run
#   {command}
# (pins: {pins}; tools: {tools}). Do not edit by hand.
"""


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _public(version: str) -> str:
    return version.split("+")[0]  # 2.13.0+cpu is the lock's 2.13.0 (PEP 440 local label)


def pins(lock: Path) -> list[tuple[str, str, str]]:
    """(name, version, marker) for each ``name==version ; marker`` line of ``lock``."""
    out = []
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req, _, marker = line.partition(";")
        name, sep, version = req.partition("==")
        if not sep:
            raise SystemExit(f"{lock}: '{line}' is not name==version")
        out.append((_name(name.strip()), version.strip(), marker.strip()))
    return out


def lock(path: Path, uv: str, pin: list[str], upgrade: bool) -> int:
    """Regenerate ``path`` with uv, keeping its versions unless ``upgrade``; print the changes."""
    old = _by_key(path) if path.exists() else {}
    inputs = Path("build/lock")  # ignored; named in the lock's header and its "via" notes
    inputs.mkdir(parents=True, exist_ok=True)
    (inputs / "pins.txt").write_text("".join(f"{p}\n" for p in pin))
    (inputs / "tools.in").write_text("".join(f"{t}\n" for t in TOOLS))
    args = ["uv", "pip", "compile", "pyproject.toml", f"{inputs}/tools.in", "--extra", "test",
            "--extra", "gpu", "--universal", "--python-version", "3.10", "-c",
            f"{inputs}/pins.txt", "--no-header", "-q", "-o", str(path)]  # uv keeps the lock's
    # versions (the ones its output file already has)
    done = subprocess.run([uv, *args[1:], *(["--upgrade"] if upgrade else [])])
    if done.returncode:
        return done.returncode
    path.write_text(HEADER.format(command=" ".join(args), pins=" ".join(pin) or "none",
                                  tools=" ".join(TOOLS)) + path.read_text())
    new = _by_key(path)
    changes = [f"  {k}: {old.get(k, '(new)')} -> {new.get(k, '(removed)')}"
               for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    print(f"{path.name}: {len(changes)} change(s)" + "".join(f"\n{c}" for c in changes))
    return 0


def _by_key(lock: Path) -> dict[str, str]:
    """name -> its version(s): "2.4.6", or "2.2.6 ; <marker>, 2.4.6 ; <marker>" where forked."""
    grouped: dict[str, list[str]] = {}
    for n, v, m in pins(lock):
        grouped.setdefault(n, []).append(f"{v} ; {m}" if m else v)
    return {n: ", ".join(vs) for n, vs in grouped.items()}


def _installed() -> dict[str, str]:
    return {_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def _kept_torch(lock: Path) -> str | None:
    """The installed torch's version when it differs from the lock's, else None."""
    have = _installed().get("torch")
    want = {v for n, v, _ in pins(lock) if n == "torch"}
    return have if have and want and _public(have) not in want else None


def constraints(lock: Path, out: Path) -> int:
    lines = lock.read_text().splitlines()
    kept = _kept_torch(lock)
    if kept:
        print(f"torch {kept} is installed and stays (the lock has another): torch, triton, "
              "nvidia-* and cuda-* are not pinned", file=sys.stderr)
        lines = [ln for ln in lines if "==" not in ln
                 or not TORCH_ONLY.match(_name(ln.split("==")[0].strip()))]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return 0


def _applicable(lock: Path) -> dict[str, str]:
    """name -> pinned version, for the lock lines whose markers hold in this environment."""
    from packaging.markers import Marker

    return {n: v for n, v, m in pins(lock) if not m or Marker(m).evaluate()}


def check(lock: Path) -> int:
    """Every installed package the lock names has the lock's version, and pip check is clean."""
    want, have = _applicable(lock), _installed()
    kept = _kept_torch(lock)
    wrong = [f"{n} {have[n]} (lock: {v})" for n, v in sorted(want.items())
             if n in have and _public(have[n]) != v and not (kept and TORCH_ONLY.match(n))]
    extra = sorted(set(have) - set(want) - NOT_LOCKED)
    pip = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    if extra:
        print(f"note: installed but not in {lock.name}: {', '.join(extra)}")
    if kept:
        print(f"note: torch {kept} kept instead of the lock's (installed before `make install`)")
    if wrong:
        print(f"error: installed versions differ from {lock.name}: {'; '.join(wrong)}. Fix: "
              f"`make clean install`, or `pip install -c {lock.name} -e .[test]`", file=sys.stderr)
    if pip.returncode:
        print(f"error: pip check:\n{pip.stdout}{pip.stderr}", file=sys.stderr)
    if wrong or pip.returncode:
        return 1
    print(f"installed versions match {lock.name} ({len(want.keys() & have.keys())} packages), "
          "pip check clean")
    return 0


def _failures(junit: Path) -> tuple[list[str], int, int]:
    """The failed tests (with the first line of their message), how many ran, how many skipped."""
    failed, total, skipped = [], 0, 0
    for case in ET.parse(junit).iter("testcase") if junit.exists() else ():
        total += 1
        skipped += any(e.tag == "skipped" for e in case)
        bad = next((e for e in case if e.tag in ("failure", "error")), None)
        if bad is not None:
            reason = (bad.get("message") or "").strip().splitlines()[:1]
            failed.append(f"  {case.get('classname')}::{case.get('name')}"
                          + (f": {reason[0][:150]}" if reason else ""))
    return failed, total, skipped


def report(lock: Path, junit: Path) -> int:
    """Which installed versions differ from the lock, and which tests failed (pytest's junit)."""
    want, have = _applicable(lock), _installed()
    differ = [f"  {n}: {v} (lock) -> {have[n]}" for n, v in sorted(want.items())
              if n in have and _public(have[n]) != v]
    differ += [f"  {n}: not in the lock -> {have[n]}"
               for n in sorted(set(have) - set(want) - NOT_LOCKED)]
    failed, total, skipped = _failures(junit)
    print(f"== make test-latest: {len(differ)} version(s) differ from {lock.name}")
    print("\n".join(differ) or "  none")
    print(f"== tests failing with them: {len(failed)} of {total} ({skipped} skipped)")
    print("\n".join(failed) or ("  none" if total else "  no results: the suite did not run"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("lock", help="regenerate the lock with uv and print what changed")
    p.add_argument("lock", type=Path)
    p.add_argument("--uv", default="uv", help="the uv executable")
    p.add_argument("--pin", action="append", default=[], help="e.g. torch==2.13.0")
    p.add_argument("--upgrade", action="store_true", help="the newest versions allowed")
    p = sub.add_parser("constraints", help="write the constraints make install uses")
    p.add_argument("lock", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("check", help="installed versions equal the lock's; pip check")
    p.add_argument("lock", type=Path)
    p = sub.add_parser("report", help="make test-latest's report")
    p.add_argument("lock", type=Path)
    p.add_argument("junit", type=Path)
    a = parser.parse_args(argv)
    if a.command == "lock":
        return lock(a.lock, a.uv, a.pin, a.upgrade)
    if a.command == "constraints":
        return constraints(a.lock, a.out)
    return check(a.lock) if a.command == "check" else report(a.lock, a.junit)


if __name__ == "__main__":
    sys.exit(main())
