"""Benchmark the offline converter on real-size Llama checkpoints (random bf16 weights).

Creates once (cached under ``build/bench_convert/``) an HF checkpoint with the real
Llama-3.2-1B config and one with the real Llama-3.1-8B config, bf16, random weights, written
tensor by tensor (the generator never holds the model). Then, per model, in this order:

1. ``cp -r`` of the HF folder (the baseline: same bytes, same disk, same run);
2. ``mdtk convert HF MCORE --to mcore --tp 2 --pp 2``;
3. ``cp -r`` of the torch_dist folder;
4. ``mdtk convert MCORE HF2 --to hf``;
5. (``--check``) every tensor of HF2 compared bit-exactly with the original.

Each step runs as its own process; wall time and the peak RSS of the whole process tree
(sampled every 20 ms from /proc through psutil, summed over the tree) are recorded. Ratios are
conversion / ``cp -r`` of its source. Targets: time <= 2x ``cp -r``; peak RSS <= 1.5 GiB +
2x the largest tensor.

    .venv/bin/python scripts/bench_convert.py --models 1b 8b [--workers 1] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "bench_convert"
MDTK = str(Path(sys.executable).parent / "mdtk")

_LLAMA3_ROPE = {"rope_type": "llama3", "original_max_position_embeddings": 8192,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# The published config.json values of meta-llama/Llama-3.2-1B and meta-llama/Llama-3.1-8B.
_LLAMA3 = dict(architectures=["LlamaForCausalLM"], num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
               rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001, hidden_act="silu",
               attention_bias=False, mlp_bias=False, torch_dtype="bfloat16")
CONFIGS = {
    "1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               head_dim=64, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
               tie_word_embeddings=True),
    "8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               head_dim=128, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
               tie_word_embeddings=False),
}


def make_checkpoint(name: str) -> Path:
    """The cached random-weight HF folder of model ``name`` (built on first use)."""
    import torch
    import transformers

    from toolkit.adapters import adapter_for
    from toolkit.checkpoint.hf import HFWriter

    out = CACHE / f"hf-{name}"
    if (out / ".complete").is_file():
        return out
    if out.exists():
        shutil.rmtree(out)
    config = transformers.LlamaConfig(**CONFIGS[name])
    adapter = adapter_for(config)
    expected = adapter.expected_tensors()
    plan = {n: (tuple(s), torch.bfloat16) for n, s in expected.items()}
    writer = HFWriter(out, plan=plan, max_shard_bytes=5 * 10**9)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for n, shape in expected.items():
        if n.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        writer.add(n, t.to(torch.bfloat16))
        del t
    writer.finish(adapter.export_config(torch.bfloat16))
    (out / ".complete").write_text("")
    print(f"built {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def largest_tensor_bytes(path: Path) -> int:
    from toolkit.checkpoint.hf import HFReader

    with HFReader(path) as r:
        return max(math.prod(r.shape(n)) * r.dtype(n).itemsize for n in r.names)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(cmd: list[str]) -> dict:
    """Wall time and peak RSS (summed over the process tree) of one command."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    return {"seconds": seconds, "peak_rss": peak}


def compare(a: Path, b: Path) -> int:
    import torch

    from toolkit.checkpoint.hf import HFReader

    with HFReader(a) as ra, HFReader(b) as rb:
        assert sorted(ra.names) == sorted(rb.names), "tensor names differ"
        for n in ra.names:
            full = tuple((0, s) for s in ra.shape(n))
            x, y = ra.read(n, full), rb.read(n, full)
            if x.dtype != y.dtype or not torch.equal(x, y):
                raise SystemExit(f"{n} differs after the round trip")
        return len(ra.names)


def bench(name: str, workers: int, check: bool, keep: bool) -> dict:
    src = make_checkpoint(name)
    work = CACHE / f"run-{name}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    largest = largest_tensor_bytes(src)
    res: dict = {"model": name, "hf_bytes": folder_bytes(src), "largest_tensor": largest,
                 "rss_target": int(1.5 * 2**30 + 2 * largest), "workers": workers}
    res["cp_hf"] = measure(["cp", "-r", str(src), str(work / "cp-hf")])
    shutil.rmtree(work / "cp-hf")
    res["hf_to_mcore"] = measure([MDTK, "convert", str(src), str(work / "mcore"), "--to", "mcore",
                                  "--tp", "2", "--pp", "2", "--workers", str(workers), "-q"])
    res["mcore_bytes"] = folder_bytes(work / "mcore")
    res["cp_mcore"] = measure(["cp", "-r", str(work / "mcore"), str(work / "cp-mcore")])
    shutil.rmtree(work / "cp-mcore")
    res["mcore_to_hf"] = measure([MDTK, "convert", str(work / "mcore"), str(work / "hf"), "--to",
                                  "hf", "-q"])
    if check:
        res["checked_tensors"] = compare(src, work / "hf")
    for step, base in (("hf_to_mcore", "cp_hf"), ("mcore_to_hf", "cp_mcore")):
        res[step]["time_ratio"] = res[step]["seconds"] / res[base]["seconds"]
        res[step]["rss_ok"] = res[step]["peak_rss"] <= res["rss_target"]
    if not keep:
        shutil.rmtree(work)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["1b"], choices=sorted(CONFIGS))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exact comparison")
    ap.add_argument("--keep", action="store_true", help="keep the converted folders")
    args = ap.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    results = []
    gib = 2**30
    for name in args.models:
        r = bench(name, args.workers, not args.no_check, args.keep)
        results.append(r)
        print(f"\n{name}: HF {r['hf_bytes'] / gib:.2f} GiB, torch_dist {r['mcore_bytes'] / gib:.2f}"
              f" GiB, largest tensor {r['largest_tensor'] / gib:.2f} GiB, RSS target "
              f"{r['rss_target'] / gib:.2f} GiB")
        print(f"  cp -r HF:            {r['cp_hf']['seconds']:7.1f} s  peak RSS "
              f"{r['cp_hf']['peak_rss'] / gib:.2f} GiB")
        for step, base in (("hf_to_mcore", "cp_hf"), ("mcore_to_hf", "cp_mcore")):
            s = r[step]
            if base == "cp_mcore":
                print(f"  cp -r torch_dist:    {r[base]['seconds']:7.1f} s")
            label = "HF -> mcore tp2 pp2" if step == "hf_to_mcore" else "mcore -> HF"
            print(f"  {label + ':':20s} {s['seconds']:7.1f} s  ({s['time_ratio']:.2f}x cp -r)  "
                  f"peak RSS {s['peak_rss'] / gib:.2f} GiB "
                  f"({'within' if s['rss_ok'] else 'ABOVE'} target)")
        if "checked_tensors" in r:
            print(f"  round trip bit-exact: {r['checked_tensors']} tensors")
    (CACHE / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nresults: {CACHE / 'results.json'}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
