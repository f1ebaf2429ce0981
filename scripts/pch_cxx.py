#!/usr/bin/env python3
"""The C++ compiler for DeepSpeed's JIT-built CPU ops (``CXX``, set by the Makefile and
tests/conftest.py): ``c++`` with the same flags, made cheaper in two ways that leave the
machine code as it was.

* ``-g0``: DeepSpeed asks for debug info (``-g``), which gcc spends much of each file's time
  on, for torch's headers; gcc's code does not depend on ``-g``.
* An op of many files (async_io: 12) gets ``<torch/extension.h>`` precompiled once per set of
  flags and pre-included in each file that includes torch: that header is most of such a
  file's compile. A file that does not include torch is compiled as it is (pre-included, the
  header's deferred template work costs ~7 CPU-s in every file: 0.6 s -> 7.5 s each for three
  of async_io's files). An op of few files (CPU Adam: 2) is faster without (the header is
  parsed once per file anyway).

A fresh clone's ops then build in a fraction of the CPU time (docs/benchmarks.md, "Test
suite"). Anything but a torch-extension compile (links, other files) goes to ``c++``
unchanged, and a file that fails with the precompiled header is compiled again without it.
``MDTK_REAL_CXX`` names the compiler (default ``c++``). Standard library only.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

MARK = "-DTORCH_API_INCLUDE_EXTENSION_H"  # torch's flag on every extension source
PCH_FROM_FILES = 4  # ops with at least this many sources get the precompiled header
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
TORCH_HEADERS = ("torch/", "ATen/", "c10/", "pybind11/")  # what the precompiled header holds


def _flags(args: list[str]) -> list[str]:
    """The compile flags without the file names (-c SRC, -o OUT, -MF DEP, -MMD)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-c", "-o", "-MF"):
            skip = True
        elif a != "-MMD":
            out.append(a)
    return out


def _many_files() -> bool:
    """Whether the op being built (ninja runs in its build folder) has many sources."""
    try:
        text = Path("build.ninja").read_text()
    except OSError:
        return False
    return sum(1 for line in text.splitlines()
               if line.startswith("build ") and ": compile " in line) >= PCH_FROM_FILES


def _includes_torch(source: Path, dirs: list[Path], seen: set[Path] | None = None) -> bool:
    """Whether ``source`` includes a torch header, directly or through headers found beside it
    or in ``dirs`` (the -I folders; torch's own are -isystem and never searched)."""
    seen = set() if seen is None else seen
    try:
        text = source.read_text(errors="replace")
    except OSError:
        return False
    for name in _INCLUDE.findall(text):
        if name.startswith(TORCH_HEADERS):
            return True
        for folder in (source.parent, *dirs):
            found = (folder / name).resolve()
            if found.is_file():
                if found not in seen:
                    seen.add(found)
                    if _includes_torch(found, dirs, seen):
                        return True
                break
    return False


def _source_includes_torch(args: list[str]) -> bool:
    dirs = [Path(a[2:]) for a in args if a.startswith("-I") and len(a) > 2]
    return _includes_torch(Path(args[args.index("-c") + 1]), dirs)


def _pch(cxx: list[str], args: list[str]) -> Path | None:
    """The precompiled header for these flags, built once (under a lock) beside the output;
    None if gcc cannot build it."""
    flags = _flags(args)
    key = hashlib.sha1("\0".join(cxx + flags).encode()).hexdigest()[:16]
    folder = Path(args[args.index("-o") + 1]).resolve().parent / f"pch-{key}"
    folder.mkdir(exist_ok=True)
    header = folder / "torch_extension.h"
    with open(folder / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "failed").exists():
            return None
        if not Path(f"{header}.gch").exists():
            header.write_text("#include <torch/extension.h>\n")
            tmp = folder / "tmp.gch"
            done = subprocess.run(cxx + flags + ["-x", "c++-header", str(header), "-o", str(tmp)])
            if done.returncode != 0:
                (folder / "failed").touch()
                return None
            tmp.rename(f"{header}.gch")
    return header


def use_in(env) -> None:
    """Point the DeepSpeed op builds of ``env`` (a mutable mapping: ``os.environ`` or a child's
    environment) at what `make install` uses (Makefile): this checkout's op cache unless one is
    set, and this wrapper as ``CXX``. The compiler's path is part of torch's build command, so a
    process with another ``CXX`` would build every op again instead of loading it: a cache set
    from outside (shared by several checkouts) gets the wrapper's copy kept in it
    (``shared_copy``), the same path from every checkout."""
    here = Path(__file__).resolve()
    shared = "TORCH_EXTENSIONS_DIR" in env
    env.setdefault("TORCH_EXTENSIONS_DIR", str(here.parent.parent / "build" / "torch_extensions"))
    if not env.get("CXX", "").endswith("pch_cxx.py"):
        env.setdefault("MDTK_REAL_CXX", env.get("CXX", "c++"))
        env["CXX"] = str(shared_copy(Path(env["TORCH_EXTENSIONS_DIR"])) if shared else here)


def shared_copy(cache: Path) -> Path:
    """This wrapper copied into an op cache, named by its content's hash. Checkouts (git
    worktrees) sharing one cache otherwise each give torch their own wrapper's path, and every
    op is built again whenever another checkout built it last (async_io ~120 CPU-s, CPU Adam
    ~55, inside whichever test loads it first)."""
    text = Path(__file__).read_bytes()
    target = cache / "pch_cxx" / hashlib.sha1(text).hexdigest()[:12] / "pch_cxx.py"
    if not (target.is_file() and target.read_bytes() == text):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".pch_cxx.{os.getpid()}.tmp")
        tmp.write_bytes(text)
        tmp.chmod(0o755)
        os.replace(tmp, target)  # whole or absent: a concurrent checkout may read it
    return target


def main(args: list[str]) -> int:
    cxx = [os.environ.get("MDTK_REAL_CXX", "c++")]
    if "-c" in args and "-o" in args and MARK in args:
        args = args + ["-g0"]
        header = _pch(cxx, args) if _many_files() and _source_includes_torch(args) else None
        if header is not None:
            done = subprocess.run(cxx + ["-include", str(header)] + args)
            if done.returncode == 0:
                return 0
            print(f"pch_cxx: compiling again without {header}", file=sys.stderr)
    os.execvp(cxx[0], cxx + args)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
