"""Every GPU claim of mdtk measured in one short GPU window (one H100 or H200, under 8 minutes).

GPU time comes rarely, in windows of about 15 minutes with the machine's start included, so one
command runs everything and writes one JSON and one Markdown summary to OUT:

    python scripts/gpu_check.py OUT [--budget 475] [--only a,b] [--tests F,F] [--wheels DIR]
    python scripts/gpu_check.py OUT --dry-run          # on CPU: the plan, every command checked
    python scripts/gpu_check.py --prepare-wheels DIR   # here: wheels the GPU image lacks (lock)
    python scripts/gpu_check.py --record OUT/gpu_check.json   # here: docs/benchmarks.md's GPU part

Each part runs in its own process with a time limit; a part that fails is recorded with the
end of its output and the others go on; a part that would not fit in what is left of the
budget is skipped and said so. The device's memory in use is sampled (nvidia-smi) while each
part runs, so every part gets a peak whatever it is. The machine starts bare and cannot reach a
package index: ``--prepare-wheels`` downloads here the lock's versions of what the image lacks
(mdtk's own dependencies; the image's CUDA torch stays) and ``--wheels`` installs them there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import pch_cxx  # beside this file: the compiler wrapper of DeepSpeed's op builds
from gpu_check_report import BENCHMARKS, markdown, record

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
MAX_WALL_S = 480  # the bound: the whole check in under 8 minutes
#: What the GPU image (torch with CUDA, transformers, ...) lacks or holds at other versions
#: than the lock: carried as wheels, installed with --no-deps into a folder put first on the path.
CARRY = ("megatron-core", "deepspeed", "transformers", "datasets", "dill", "multiprocess",
         "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
         "typing-extensions", "typer", "annotated-doc", "shellingham", "peft", "trl",
         "liger-kernel")
VERSIONS = ("torch", "megatron-core", "deepspeed", "transformers", "transformer-engine",
            "flash-attn", "peft", "trl", "accelerate", "safetensors", "numpy", "liger-kernel",
            "triton")
#: Llama-3.2-1B shape, bf16, one GPU; metrics read every 4 steps (logging.interval), so 12 steps
#: give two timed intervals after the first (warm-up)
TRAIN = dict(seq=4096, micro=2, accum=4, steps=12)


@dataclasses.dataclass(frozen=True)
class Part:
    """One measured claim: a command that writes its figures as JSON to ``{json}``."""

    name: str
    what: str
    est_s: float
    argv: Callable[[Path], list[str]]  # result path -> command
    help_argv: list[str] | None = None  # the dry run's check that the command parses
    read: Callable[[Path], dict] = lambda p: json.loads(p.read_text())
    default: bool = True  # in a run without --only (the default parts fit one window)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _pytest_read(path: Path) -> dict:
    """Counts and each test's outcome from pytest's JUnit XML."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests = {}
    for case in suite.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        detail = ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = f"{tag}: {(node.get('message') or '').splitlines()[0][:200]}"
                detail = (node.text or "")[-6000:]  # the traceback's end: what to fix
        tests[name] = {"outcome": outcome, "s": float(case.get("time") or 0),
                       **({"detail": detail} if detail and not outcome.startswith("skipped")
                          else {})}
    return {"cases": tests, **{k: int(suite.get(k) or 0)
                               for k in ("tests", "failures", "errors", "skipped")}}


GPU_TESTS = ["tests/test_gpu.py", "tests/test_gpu_cp.py", "tests/test_gpu_zeropp.py",
             "tests/test_gpu_packing.py",  # packing: ~15 s (bench_packing.py, 64 examples)
             "tests/test_gpu_kernels.py", "tests/test_gpu_checkpoint.py"]  # --tests: a subset


def _train(*extra: str) -> Callable[[Path], list[str]]:
    """bench_train.py's GPU part at TRAIN's shape, with ``extra`` options."""
    return lambda j: _py("scripts/bench_train.py", "--skip-cpu", "--gpu-seq", str(TRAIN["seq"]),
                         "--gpu-micro", str(TRAIN["micro"]), "--gpu-accum", str(TRAIN["accum"]),
                         "--gpu-steps", str(TRAIN["steps"]), *extra, "--json", str(j))


PARTS: list[Part] = [
    Part("versions", "nvidia-smi, torch/CUDA, megatron-core, DeepSpeed, TE, flash-attn", 10,
         lambda j: _py(__file__, "--versions", str(j)), _py(__file__, "--help")),
    Part("gpu_tests", "the tests marked gpu (pytest -m gpu)", 190,  # H200: 146 s + new files
         lambda j: _py("-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                       f"--junitxml={j}", *GPU_TESTS),
         _py("-m", "pytest", "-q", "-m", "gpu", "--collect-only", "-p", "no:cacheprovider",
             *GPU_TESTS),
         _pytest_read),
    Part("train_mfu", "mdtk train vs a bare megatron-core loop, Llama-3.2-1B shape, bf16, "
         f"seq {TRAIN['seq']}, micro {TRAIN['micro']} x {TRAIN['accum']}, ZeRO-1, fused "
         "kernels auto, fused AdamW, metrics every 4 steps", 60,  # 43 s of 8 steps on an H200
         _train(), _py("scripts/bench_train.py", "--help")),
    Part("train_mfu_unfused", "train_mfu without the fused kernels (train.fused_kernels=off)",
         55, _train("--gpu-kernels", "off"), _py("scripts/bench_train.py", "--help")),
    Part("kernels", "the fused kernels vs the ops they replace, fwd+bwd at the 1B micro-batch: "
         "SwiGLU, the loss (logits materialised or not), RMSNorm", 30,
         lambda j: _py("scripts/bench_kernels.py", "--json", str(j)),
         _py("scripts/bench_kernels.py", "--help")),
    Part("lora", "LoRA r=16 vs full fine-tuning through mdtk train: step time and memory, "
         "a 0.5B Llama (Llama-3.2-1B widths, 8 layers), bf16, seq 2048", 45,
         lambda j: _py("scripts/bench_lora.py", "--skip-cpu", "--json", str(j)),
         _py("scripts/bench_lora.py", "--help"), default=False),
    Part("attention", "CP attention (cp=1) vs megatron-core local vs SDPA, 8k and 32k, fwd+bwd",
         30,  # 25 s on an H100
         lambda j: _py("scripts/bench_attention.py", "--seqs", "8192,32768", "--json", str(j)),
         _py("scripts/bench_attention.py", "--help"), default=False),
    Part("zeropp", "ZeRO++ quantizer kernels (qwZ int8, qgZ int4) vs a copy, 8192 x 8192 bf16: "
         "time, error; the op built by gpu_tests (else its JIT build)", 25,
         lambda j: _py("scripts/bench_zeropp.py", "--json", str(j)),
         _py("scripts/bench_zeropp.py", "--help")),
    # 4 layers x 3 rounds took > 121 s on an H100 (~40 s a round for 7 GB): 1 layer (4.5 GB,
    # the 1B model's tensor shapes) and an async-only warm-up
    Part("checkpoint", "async checkpoint stall vs synchronous save vs DeepSpeed save_checkpoint, "
         "Llama-3.2-1B shape (1 layer), bf16 ZeRO-1, GPU engine, pinned host copy", 55,
         lambda j: _py("scripts/bench_checkpoint.py", "--device", "cuda", "--layers", "1",
                       "--rounds", "1", "--seq", "512", "--json", str(j)),
         _py("scripts/bench_checkpoint.py", "--help")),
    Part("indexed_data", "mdtk train on a 0.25/0.75 blend of two Megatron indexed prefixes "
         "(mdtk data preprocess), tiny Llama, bf16, 30 steps", 30,
         lambda j: _py("scripts/bench_data.py", "--gpu-train", str(j)),
         _py("scripts/bench_data.py", "--help"), default=False),
    Part("dpo", "DPO step time and peak memory (reference model / precomputed) vs SFT on the "
         "same tokens, and the memory model's figures, 150M Llama, bf16, 8 steps", 50,
         # one round of the 3 runs (~15 s each; the H100 run's first, SFT, ended at ~30 s)
         lambda j: _py("scripts/bench_dpo.py", "--steps", "8", "--rounds", "1", "--json",
                       str(j)),
         _py("scripts/bench_dpo.py", "--help")),
    Part("generate", "mdtk generate's engine (megatron-core static batch, KV cache) vs "
         "transformers.generate, greedy, bf16, a 0.4B Llama (hidden 2048, 8 layers, vocab 32k), "
         "batch 8 x 128 prompt tokens + 64 new; decode ms/token at context 64 vs 1024", 40,
         lambda j: _py("scripts/bench_generate.py", "--hidden", "2048", "--layers", "8",
                       "--vocab", "32000", "--batch", "8", "--prompt-len", "128", "--new", "64",
                       "--rounds", "3", "--json", str(j)),
         _py("scripts/bench_generate.py", "--help"), default=False),
    Part("grpo", "online RL step split (rollout on the training rank, reference / old "
         "log-probs, update): bundled:examples/grpo_tiny.yaml on the demo's tiny Llama, one "
         "round of 20 steps per setting", 40,
         lambda j: _py("scripts/bench_grpo.py", "--device", "cuda", "--rounds", "1", "--steps",
                       "20", "--json", str(j)),
         _py("scripts/bench_grpo.py", "--help"), default=False),
    Part("grpo_vllm", "the grpo part's example with rollouts from vLLM colocated on the rank "
         "(grpo.engine: vllm: the live weights streamed in before each batch) beside mdtk's "
         "engine, a tiny Llama with head size 32; skipped where vllm is not installed", 60,
         lambda j: _py("scripts/bench_grpo.py", "--device", "cuda", "--rounds", "1", "--steps",
                       "20", "--settings", "example,vllm", "--hidden", "128", "--head-dim",
                       "32", "--json", str(j)),
         _py("scripts/bench_grpo.py", "--help"), default=False),
    Part("train_mfu_zero0", "train_mfu at ZeRO-0 (DeepSpeed's bf16 optimizer, no partitions: "
         "what ZeRO-1 is at dp=1 without its flat-partition machinery)", 55,
         _train("--zero", "0"), _py("scripts/bench_train.py", "--help"), default=False),
]


def planner_vs_measured(train: dict) -> dict:
    """The planner's step time for the layout train_mfu measured, against the measurement."""
    sys.path.insert(0, str(ROOT))
    from toolkit.memory.model import model_shape_from_hf
    from toolkit.planner import Candidate, Network, Workload, get_device, step_cost
    from toolkit.planner.devices import device_for_name

    device = device_for_name(train.get("device")) or get_device("h100")
    shape = model_shape_from_hf({**train["model"], "model_type": "llama"})
    work = Workload(seq_len=train["seq"], global_batch=train["micro_batch"] * train["accumulation"])
    cost = step_cost(shape, work, Candidate(zero=1, micro_batch=train["micro_batch"]),
                     Network(device, gpus_per_node=1))
    return {"device_table": device.name, "predicted_s": cost.step,
            "measured_s": train["train_step_s"], "predicted_over_measured":
            cost.step / train["train_step_s"], "predicted_mfu": cost.mfu}


# -- running -----------------------------------------------------------------------------------

class MemorySampler:
    """Peak device memory in use (all processes) while a part runs, from nvidia-smi."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True,
                                     text=True, timeout=5).stdout
                self.peak_mib = max([self.peak_mib] + [int(x) for x in out.split()])
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return

    def __enter__(self) -> MemorySampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def run_part(part: Part, work: Path, left_s: float, env: dict[str, str]) -> dict:
    """Run one part within ``left_s`` seconds; its figures, or why there are none."""
    result = work / f"{part.name}.json"
    record: dict = {"what": part.what, "est_s": part.est_s}
    limit = min(left_s, max(2.0 * part.est_s, part.est_s + 60))
    start = time.monotonic()
    with MemorySampler() as mem:
        try:
            proc = subprocess.run(part.argv(result), cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=limit)
            record["rc"] = proc.returncode
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            record["rc"] = "timeout"
            tail = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                    else (e.stdout or ""))[-3000:]
    record["s"] = round(time.monotonic() - start, 1)
    record["peak_device_mib"] = mem.peak_mib
    try:
        record["figures"] = part.read(result)
    except (OSError, ValueError, ET.ParseError, AttributeError) as e:
        record["figures"] = None
        record["error"] = _cause(record["rc"], limit, tail) or f"no figures ({type(e).__name__})"
    ok = record["rc"] == 0 or (part.name == "gpu_tests" and record["figures"])
    record["status"] = "ok" if ok and record["figures"] else "failed"
    if record["status"] != "ok":
        record["output_tail"] = tail
    return record


def _cause(rc: int | str, limit: float, tail: str) -> str:
    """Why a part left no figures, in one line: its time limit, or the last exception printed."""
    if rc == "timeout":
        return f"killed at its time limit ({limit:.0f} s)"
    errors = [ln.split("]: ", 1)[-1].strip() for ln in tail.splitlines()
              if re.match(r"^(\[rank\d+\]: )?[\w.]+(Error|Exception|Failure)\b", ln.strip())]
    return errors[-1][:300] if errors else ""


def install_wheels(wheels: Path, site: Path) -> dict:
    """The carried wheels into ``site`` (put first on PYTHONPATH), without dependencies."""
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--no-compile", "--upgrade", "--target", str(site),
                           *files], capture_output=True, text=True)
    return {"wheels": [Path(f).name for f in files], "rc": proc.returncode,
            "s": round(time.monotonic() - start, 1), "output_tail": proc.stderr[-2000:]}


def device_arch() -> str | None:
    """This machine's GPUs' compute capabilities ("9.0"), from nvidia-smi; None if unknown."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps = sorted(set(out), key=lambda c: tuple(int(x) for x in c.split(".")))
    return ";".join(caps) if caps and all(c.replace(".", "").isdigit() for c in caps) else None


def run_all(out: Path, parts: list[Part], budget: float, wheels: Path | None) -> dict:
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MDTK_DEVICE": "cuda", "DS_ACCELERATOR": "cuda"}
    report: dict = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "budget_s": budget, "parts": {},
                    **({"only": [p.name for p in parts]} if len(parts) < len(PARTS) else {})}
    # DeepSpeed's JIT op builds (ZeRO++'s quantizer) for this GPU only, not for every arch the
    # image lists: one arch builds in a fraction of the time (the image's list is recorded).
    arch = device_arch()
    report["torch_cuda_arch_list"] = {"image": os.environ.get("TORCH_CUDA_ARCH_LIST"),
                                      "used": arch or os.environ.get("TORCH_CUDA_ARCH_LIST")}
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    # one op cache and one compiler command for every part (those of make install and
    # tests/conftest.py), so the quantizer op gpu_tests builds is loaded, not built again, by zeropp
    pch_cxx.use_in(env)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        if wheels is not None:
            report["install"] = install_wheels(wheels, work / "site")
            env["PYTHONPATH"] = os.pathsep.join([str(work / "site"), str(ROOT),
                                                 env.get("PYTHONPATH", "")])
        else:
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        for part in parts:
            left = budget - (time.monotonic() - started)
            if left < part.est_s:
                report["parts"][part.name] = {
                    "what": part.what, "est_s": part.est_s, "status": "skipped",
                    "error": f"would not fit: estimated {part.est_s:.0f} s, {left:.0f} s left"}
            else:
                report["parts"][part.name] = run_part(part, work, left, env)
            print(f"[gpu_check] {part.name}: {report['parts'][part.name]['status']} "
                  f"({report['parts'][part.name].get('s', 0)} s)", flush=True)
        train = report["parts"].get("train_mfu", {})
        if train.get("status") == "ok" and isinstance(train["figures"].get("gpu"), dict):
            try:
                report["parts"]["planner"] = {"what": "planner's step time vs measured",
                                              "status": "ok",
                                              "figures": planner_vs_measured(
                                                  train["figures"]["gpu"])}
            except Exception as e:  # recorded, as any part's failure
                report["parts"]["planner"] = {"status": "failed", "error": repr(e)}
    report["wall_s"] = round(time.monotonic() - started, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    return report


# -- the tools of the parts (run in the part's own process) ------------------------------------

def versions() -> dict:
    """Versions as installed (the carried wheels first), CUDA, the device, nvidia-smi."""
    import importlib.metadata as md

    out: dict = {"python": sys.version.split()[0], "packages": {}}
    for dist in VERSIONS:
        try:
            out["packages"][dist] = md.version(dist)
        except md.PackageNotFoundError:
            out["packages"][dist] = None
    out["lock_mismatches"] = {d: {"lock": v, "installed": out["packages"].get(d) or _installed(d)}
                              for d, v in lock_versions().items()
                              if d in CARRY + VERSIONS and d != "torch"
                              and (out["packages"].get(d) or _installed(d)) != v}
    import torch

    out["cuda"] = torch.version.cuda
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    smi = shutil.which("nvidia-smi")
    out["nvidia_smi"] = subprocess.run([smi], capture_output=True, text=True).stdout if smi \
        else None
    return out


def _installed(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def lock_versions(python: str = "3.12") -> dict[str, str]:
    """``name==version`` pins of requirements.lock whose markers hold on ``python`` (Linux);
    without a lock, the versions installed here."""
    if not LOCK.is_file():
        return {d: v for d in CARRY if (v := _installed(d))}
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "os_name": "posix"}
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        req = Requirement(line)
        if req.marker is not None and not Marker(str(req.marker)).evaluate(env):
            continue
        spec = next(iter(req.specifier), None)
        if spec is not None and spec.operator == "==":
            pins[req.name.lower().replace("_", "-")] = spec.version.split("+")[0]
    return pins


def prepare_wheels(dest: Path) -> None:
    """Download (or build, for sdists) the lock's versions of CARRY for Python 3.12 x86-64."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = lock_versions()
    platforms = [arg for n in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_24",
                               "manylinux_2_17", "manylinux2014")
                 for arg in ("--platform", f"{n}_x86_64")]
    for dist in CARRY:
        if dist not in pins:
            print(f"{dist}: not in the lock, not carried")
            continue
        spec = f"{dist}=={pins[dist]}"
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              "--only-binary=:all:", "--python-version", "3.12",
                              "--implementation", "cp", *platforms, "-d", str(dest), spec],
                             capture_output=True, text=True)
        if got.returncode != 0:  # an sdist only (DeepSpeed): build a pure wheel, no ops
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(dest), spec], check=True,
                           env={**os.environ, "DS_BUILD_OPS": "0"})
        print(f"{spec}: ok")
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"{len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {dest}")


def dry_run(out: Path, parts: list[Part], budget: float) -> int:
    """The plan on CPU: every part's command built and its parsing checked; nothing needs CUDA."""
    plan, ok = [], True
    for part in parts:
        cmd = part.argv(out / f"{part.name}.json")
        check = subprocess.run(part.help_argv, cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}) if part.help_argv \
            else None
        good = check is None or check.returncode == 0
        ok &= good
        plan.append({"part": part.name, "what": part.what, "est_s": part.est_s,
                     "command": " ".join(cmd[1:]), "checked": good,
                     **({} if good else {"error": (check.stdout + check.stderr)[-1500:]})})
        print(f"{part.name:<10} {part.est_s:>5.0f} s  {'ok ' if good else 'BAD'}  "
              f"{' '.join(cmd[1:])}")
    total = sum(p["est_s"] for p in plan)
    print(f"total {total:.0f} s estimated of a {budget:.0f} s budget (bound {MAX_WALL_S} s)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check_plan.json").write_text(json.dumps(
        {"parts": plan, "total_est_s": total, "budget_s": budget}, indent=1))
    return 0 if ok and total <= budget <= MAX_WALL_S else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, help="folder for gpu_check.json / .md")
    ap.add_argument("--budget", type=float, default=475.0,
                    help=f"seconds for the whole check (at most {MAX_WALL_S})")
    ap.add_argument("--only", help="comma-separated parts to run (default: the default parts, "
                    "which fit one window; the others measure what rarely changes)")
    ap.add_argument("--dry-run", action="store_true",
                    help="plan and check every command without running it (CPU)")
    ap.add_argument("--wheels", type=Path, help="install these wheels first (no index needed)")
    ap.add_argument("--tests", help="comma-separated test files for gpu_tests (default: "
                    f"{','.join(GPU_TESTS)})")
    ap.add_argument("--prepare-wheels", type=Path, metavar="DIR",
                    help="download the wheels the GPU image lacks into DIR and stop")
    ap.add_argument("--record", type=Path, metavar="JSON",
                    help="write a check's summary into docs/benchmarks.md and stop")
    ap.add_argument("--docs", type=Path, default=BENCHMARKS, help="the file --record updates")
    ap.add_argument("--versions", type=Path, metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.versions:
        args.versions.write_text(json.dumps(versions(), indent=1))
        return 0
    if args.prepare_wheels:
        prepare_wheels(args.prepare_wheels)
        return 0
    if args.record:
        record(args.record, args.docs)
        return 0
    if args.out is None or args.budget > MAX_WALL_S:
        ap.error(f"OUT is required and --budget at most {MAX_WALL_S}")
    names = args.only.split(",") if args.only else [p.name for p in PARTS if p.default]
    unknown = set(names) - {p.name for p in PARTS}
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; known: {[p.name for p in PARTS]}")
    parts = [p for p in PARTS if p.name in names]
    if args.tests:
        GPU_TESTS[:] = args.tests.split(",")
    if args.dry_run:
        return dry_run(args.out, parts, args.budget)
    report = run_all(args.out, parts, args.budget, args.wheels)
    print(markdown(report))
    return 0 if all(r.get("status") == "ok" for r in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
