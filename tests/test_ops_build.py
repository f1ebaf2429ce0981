"""DeepSpeed op builds (toolkit.runtime.ops, scripts/pch_cxx.py): a build killed half-way never
blocks the next; the compiler wrapper changes nothing but the cost.

torch's JIT build lock is a plain file that outlives a killed build; every process that then
loads the op waits for it forever (on this machine: seven sessions' test runs at once).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_checks import load_script

from toolkit.runtime import ops

ROOT = Path(__file__).resolve().parent.parent


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _lock(root, name="cpu_adam", marker_pid=None, age_s=0.0):
    (root / name).mkdir(parents=True, exist_ok=True)
    lock = root / name / "lock"
    lock.touch()
    os.utime(lock, (time.time() - age_s,) * 2)
    if marker_pid is not None:
        (root / f"{name}.building").write_text(str(marker_pid))
    return lock


def test_lock_of_a_dead_builder_is_removed_at_once(tmp_path):
    lock = _lock(tmp_path, marker_pid=_dead_pid())
    assert ops.clear_stale_lock(tmp_path, "cpu_adam") == lock
    assert not lock.exists() and not (tmp_path / "cpu_adam.building").exists()


def test_lock_of_a_live_builder_stays(tmp_path):
    lock = _lock(tmp_path, marker_pid=os.getpid(), age_s=2 * ops.STALE_LOCK_S)
    assert ops.clear_stale_lock(tmp_path, "cpu_adam") is None
    assert lock.exists()


def test_unmarked_lock_is_stale_only_when_old(tmp_path):
    lock = _lock(tmp_path, age_s=60)
    assert ops.clear_stale_lock(tmp_path, "cpu_adam") is None and lock.exists()
    os.utime(lock, (time.time() - ops.STALE_LOCK_S - 1,) * 2)
    assert ops.clear_stale_lock(tmp_path, "cpu_adam") == lock and not lock.exists()


def test_the_build_lock_of_a_killed_build_is_free_again(tmp_path, monkeypatch):
    """Builds queue on ``<op>.flock`` (a kernel lock): held by a live build, free the moment
    that build is killed, with no file to clean up."""
    import fcntl

    path = tmp_path / "async_io.flock"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not ops.build_under_way("async_io")  # no lock file yet
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from toolkit.runtime import ops\n"
         "with ops._exclusive(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
         str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert ops.build_under_way("async_io")  # what the test session asks before waiting
        with open(path, "a") as f:
            with pytest.raises(BlockingIOError):  # held while the build runs
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.kill()
            holder.wait()
            assert not ops.build_under_way("async_io")
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free at once, without cleanup
    finally:
        holder.kill()



def _wrapper():
    return load_script("pch_cxx")


def test_compiler_wrapper_passes_other_commands_through():
    """scripts/pch_cxx.py (the ops' CXX, Makefile) hands anything but a torch-extension
    compile to c++ unchanged."""
    theirs = subprocess.run(["c++", "--version"], capture_output=True, text=True)
    mine = subprocess.run([sys.executable, ROOT / "scripts" / "pch_cxx.py", "--version"],
                          capture_output=True, text=True)
    assert (mine.returncode, mine.stdout) == (0, theirs.stdout) and mine.stdout


def test_compiler_wrapper_precompiles_only_for_ops_of_many_files(tmp_path, monkeypatch):
    """The precompiled header is keyed by the flags without the file names, and used only
    where ninja builds at least PCH_FROM_FILES sources (async_io's 12, not CPU Adam's 2)."""
    w = _wrapper()
    args = ["-DX", w.MARK, "-MMD", "-MF", "a.o.d", "-O0", "-c", "a.cpp", "-o", "a.o"]
    assert w._flags(args) == ["-DX", w.MARK, "-O0"]
    monkeypatch.chdir(tmp_path)
    assert not w._many_files()  # no build.ninja: not a ninja build
    lines = [f"build f{i}.o: compile /src/f{i}.cpp" for i in range(w.PCH_FROM_FILES)]
    (tmp_path / "build.ninja").write_text("\n".join(lines[:-1] + ["build x.so: link f0.o"]))
    assert not w._many_files()
    (tmp_path / "build.ninja").write_text("\n".join(lines))
    assert w._many_files()


def test_compiler_wrapper_settings_are_make_installs():
    """``use_in``: what the Makefile exports for the op builds (the checkout's cache, this
    wrapper over the user's compiler), set once for conftest and gpu_check; a set cache or an
    already wrapped compiler stays."""
    w = _wrapper()
    env = {"CXX": "g++-13"}
    w.use_in(env)
    assert env == {"CXX": str(ROOT / "scripts" / "pch_cxx.py"), "MDTK_REAL_CXX": "g++-13",
                   "TORCH_EXTENSIONS_DIR": str(ROOT / "build" / "torch_extensions")}
    again = {**env, "TORCH_EXTENSIONS_DIR": "/elsewhere"}
    w.use_in(again)
    assert again == {**env, "TORCH_EXTENSIONS_DIR": "/elsewhere"}
    bare: dict[str, str] = {}
    w.use_in(bare)
    assert bare["MDTK_REAL_CXX"] == "c++"


def test_checkouts_sharing_an_op_cache_give_torch_one_compiler_path(tmp_path):
    """A cache set from outside (git worktrees sharing TORCH_EXTENSIONS_DIR) gets the wrapper's
    copy, named by its content: every checkout's build command is then the same, and an op one
    built is loaded by the others instead of built again."""
    w = _wrapper()
    first, second = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}, {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    w.use_in(first)
    w.use_in(second)
    cxx = Path(first["CXX"])
    assert second["CXX"] == first["CXX"] and cxx.parent.parent == tmp_path / "pch_cxx"
    assert cxx.read_bytes() == (ROOT / "scripts" / "pch_cxx.py").read_bytes()
    theirs = subprocess.run(["c++", "--version"], capture_output=True, text=True)
    mine = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    assert mine.returncode == 0 and mine.stdout == theirs.stdout  # it runs where it was copied


def test_compiler_wrapper_precompiles_only_for_files_that_include_torch(tmp_path):
    """Pre-included into a file without torch, the header costs ~7 CPU-s of template work
    (async_io's deepspeed_aio_types.cpp: 0.6 s -> 7.5 s): such files are compiled as they are.
    Includes are followed beside the file and in the -I folders, through header cycles."""
    w = _wrapper()
    src, inc = tmp_path / "src", tmp_path / "inc"
    src.mkdir(), inc.mkdir()
    (inc / "a.h").write_text('#pragma once\n#include "b.h"\n#include <vector>\n')
    (inc / "b.h").write_text('#include "a.h"\n')  # a cycle, guarded by #pragma once
    (src / "plain.cpp").write_text('#include "a.h"\nint f() { return 1; }\n')
    (src / "local.h").write_text("#include <torch/extension.h>\n")
    (inc / "deep.h").write_text('#include "b.h"\n  #  include "local_in_inc.h"\n')
    (inc / "local_in_inc.h").write_text("#include <ATen/ATen.h>\n")
    (src / "direct.cpp").write_text('#include "local.h"\n')
    (src / "nested.cpp").write_text('#include "deep.h"\n')

    def uses_pch(name: str, *flags: str) -> bool:
        return w._source_includes_torch([*flags, w.MARK, "-c", str(src / name), "-o", "x.o"])

    assert not uses_pch("plain.cpp", f"-I{inc}")
    assert uses_pch("direct.cpp")  # found beside the file
    assert uses_pch("nested.cpp", f"-I{inc}")
    assert not uses_pch("nested.cpp")  # deep.h not on the include path: not followed


def test_cpu_probe_runs_once_per_process():
    """DeepSpeed asks py-cpuinfo (a Python process per call, ~1 s of CPU) twice per op load and
    once per CPU Adam; after ``cache_cpu_info`` the first answer serves the process, a copy
    each time, and the builders' flags are what they were."""
    import cpuinfo
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from toolkit.runtime import cpu_compat

    before = AsyncIOBuilder().cxx_args()  # asks twice (-march, SIMD width)
    patched = list(cpu_compat.PATCHED)
    cpu_compat.cache_cpu_info()
    cpu_compat.cache_cpu_info()
    first = cpuinfo.get_cpu_info()
    start = time.perf_counter()
    assert AsyncIOBuilder().cxx_args() == before
    again = cpuinfo.get_cpu_info()
    assert time.perf_counter() - start < 0.1  # no process started (one takes ~1 s)
    assert cpu_compat.PATCHED == patched  # not a CPU redirect: HF references can still be built
    assert again == first and again is not first and "flags" in first
    again["flags"].clear()
    assert cpuinfo.get_cpu_info()["flags"] == first["flags"]


# -- TORCH_CUDA_ARCH_LIST for DeepSpeed's CUDA op builds (the H100 run: '9.0a' broke ZeRO++) ----

IMAGE_ARCHS = "7.5 8.0;8.6;9.0a;10.0a;12.0f+PTX"  # torch's syntax, as a CUDA image may set it


def _deepspeed_parses(arch_list: str) -> str:
    """DeepSpeed 0.19.8's own JIT arch parsing (QuantizerBuilder.compute_capability_args, which
    needs no GPU once a list is given): the list it hands torch, or its error."""
    from deepspeed.ops.op_builder.quantizer import QuantizerBuilder

    b = QuantizerBuilder()
    b.jit_mode, b._jit_arch_list = True, arch_list
    b.compute_capability_args()
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def test_arch_list_normalised_to_what_deepspeed_parses(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")  # DeepSpeed writes its result there
    with pytest.raises(ValueError, match="invalid literal for int"):
        _deepspeed_parses(IMAGE_ARCHS)  # the failure of the H100 run, reproduced on CPU
    fixed, dropped = ops.normalize_arch_list(IMAGE_ARCHS)
    assert (fixed, dropped) == ("7.5;8.0;8.6;9.0;10.0;12.0+PTX", [])
    assert _deepspeed_parses(fixed) == fixed
    assert ops.normalize_arch_list("9.0a;9.0 Hopper;9.0a+PTX") == ("9.0;9.0+PTX", ["Hopper"])
    assert ops.normalize_arch_list(" ; ") == ("", [])


def test_arch_list_prepared_once_per_process_on_cuda(monkeypatch):
    """The CUDA branch of ``prepare_cuda_arch_list`` (device choice forced, env on CPU): the
    variable is rewritten and said once; without CUDA it is left alone."""
    from toolkit import runtime

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a 10.0a")
    monkeypatch.setattr(ops, "_arch_logged", False)
    monkeypatch.setenv("MDTK_DEVICE", "cpu")
    assert ops.prepare_cuda_arch_list() is None
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a 10.0a"
    monkeypatch.setattr(runtime, "use_cuda", lambda: True)
    said: list[str] = []
    assert ops.prepare_cuda_arch_list(log=said.append) == "9.0;10.0"
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0;10.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0a")
    assert ops.prepare_cuda_arch_list(log=said.append) == "8.0"
    assert said == ["TORCH_CUDA_ARCH_LIST '9.0a 10.0a' -> '9.0;10.0' (normalised for "
                    "DeepSpeed's op builder)"]
