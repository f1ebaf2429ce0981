"""Benchmark the offline converter on real-size Llama checkpoints (random bf16 weights).

Creates once (cached under ``build/bench_convert/``) an HF checkpoint with the real
Llama-3.2-1B config and one with the real Llama-3.1-8B config, bf16, random weights, written
tensor by tensor (the generator never holds the model). Then, per model, in this order:

1. ``cp -r`` of the HF folder (the baseline: same bytes, same disk, same run);
2. ``mdtk convert HF MCORE --to mcore --tp 2 --pp 2``;
3. ``cp -r`` of the torch_dist folder;
4. ``mdtk convert MCORE HF2 --to hf``;
5. (``--check``) every tensor of HF2 compared bit-exactly with the original.

Each step runs as its own process; wall time, user and kernel CPU seconds (``wait4``'s
rusage of the step's process tree) and the peak RSS of the whole process tree (sampled every
20 ms from /proc through psutil, summed over the tree) are recorded. Ratios are
conversion / ``cp -r`` of its source. Targets: time <= 2x ``cp -r``; peak RSS <= 1.5 GiB +
2x the largest tensor.

    .venv/bin/python scripts/bench_convert.py --models 1b 8b [--repeats 3]
        [--cold | --cold-source] [--workers auto] [--keep] [--cache DIR]

``--models deepseek-v3`` benchmarks DeepSeek-V3 shapes at ep=8 instead (``bench_convert_dsv3``:
``--case bf16`` round trip with ``--experts`` routed experts, ``--case fp8`` one full MoE layer
from an FP8 source; data under ``--work``, deleted at the end; hold the disk lock).

Every timed step starts after ``sync`` (untimed), so no step pays for the writeback of the
previous one; ``--cold`` also drops the whole page cache before each (``drop_caches``, root),
``--cold-source`` only the step's source files (``posix_fadvise(POSIX_FADV_DONTNEED)`` after
the ``sync``: clean pages are dropped; Python, torch and the output stay as they are). The
rounds alternate baseline and conversion; medians, the spread and per-round ratios are
reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_measure import MDTK, fmt, folder_bytes, largest_tensor_bytes, measure, settle, stats

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "bench_convert"  # --cache

_LLAMA3_ROPE = {"rope_type": "llama3", "original_max_position_embeddings": 8192,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# The published config.json values of meta-llama/Llama-3.2-1B and meta-llama/Llama-3.1-8B.
_LLAMA3 = dict(architectures=["LlamaForCausalLM"], num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
               rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001, hidden_act="silu",
               attention_bias=False, mlp_bias=False, torch_dtype="bfloat16")
#: Both checkpoints ship a generation_config.json like this one (a conversion copies it as is).
GENERATION = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": 128001,
              "temperature": 0.6, "top_p": 0.9}
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
    from toolkit.checkpoint.hf import GENERATION_CONFIG
    from toolkit.checkpoint.hf_writer import HFWriter, TextFile

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
    writer.finish(adapter.export_config(torch.bfloat16), generation_config=TextFile(
        GENERATION_CONFIG, json.dumps(GENERATION, indent=2, sort_keys=True) + "\n"))
    (out / ".complete").write_text("")
    print(f"built {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


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


def cached_fraction(folder: Path) -> float:
    """Share of ``folder``'s bytes in the page cache (``fincore``), to check ``--cold-source``."""
    files = [str(p) for p in folder.rglob("*") if p.is_file()]
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES,SIZE", *files], check=True,
                         capture_output=True, text=True).stdout.split()
    res, size = sum(map(int, out[0::2])), sum(map(int, out[1::2]))
    return res / max(size, 1)


def bench(name: str, workers: str, check: bool, keep: bool, repeats: int, cold: str) -> dict:
    """``repeats`` rounds of (cp HF, HF -> mcore, cp mcore, mcore -> HF), baseline and subject
    alternating so both see the same machine state."""
    src = make_checkpoint(name)
    work = CACHE / f"run-{name}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    largest = largest_tensor_bytes(src)
    res: dict = {"model": name, "hf_bytes": folder_bytes(src), "largest_tensor": largest,
                 "rss_target": int(1.5 * 2**30 + 2 * largest), "workers": workers,
                 "repeats": repeats, "cold": cold}
    res["load_before"] = os.getloadavg()  # other jobs on the machine (the lock covers ours)
    runs: dict[str, list[dict]] = {k: [] for k in ("cp_hf", "hf_to_mcore", "cp_mcore",
                                                   "mcore_to_hf")}
    for _ in range(repeats):
        for d in ("mcore", "hf"):
            if (work / d).exists():
                shutil.rmtree(work / d)
        settle(cold, src)
        runs["cp_hf"].append(measure(["cp", "-r", str(src), str(work / "cp-hf")]))
        shutil.rmtree(work / "cp-hf")
        settle(cold, src)
        if cold == "source":
            res.setdefault("source_cached", []).append(cached_fraction(src))
        runs["hf_to_mcore"].append(measure([MDTK, "convert", str(src), str(work / "mcore"),
                                            "--to", "mcore", "--tp", "2", "--pp", "2",
                                            "--workers", workers, "-q"]))
        settle(cold, work / "mcore")
        runs["cp_mcore"].append(measure(["cp", "-r", str(work / "mcore"),
                                         str(work / "cp-mcore")]))
        shutil.rmtree(work / "cp-mcore")
        settle(cold, work / "mcore")
        runs["mcore_to_hf"].append(measure([MDTK, "convert", str(work / "mcore"),
                                            str(work / "hf"), "--to", "hf", "--workers",
                                            workers, "-q"]))
    res["load_after"] = os.getloadavg()
    res["mcore_bytes"] = folder_bytes(work / "mcore")
    for k, rs in runs.items():
        res[k] = {"seconds": stats([r["seconds"] for r in rs]),
                  "user": stats([r["user"] for r in rs]),
                  "kernel": stats([r["kernel"] for r in rs]),
                  "peak_rss": max(r["peak_rss"] for r in rs)}
    if check:
        res["checked_tensors"] = compare(src, work / "hf")
    for step, base in (("hf_to_mcore", "cp_hf"), ("mcore_to_hf", "cp_mcore")):
        pairs = [a["seconds"] / b["seconds"] for a, b in zip(runs[step], runs[base],
                                                              strict=True)]
        res[step]["time_ratio"] = res[step]["seconds"]["median"] / res[base]["seconds"]["median"]
        res[step]["pair_ratios"] = stats(pairs)
        res[step]["rss_ok"] = res[step]["peak_rss"] <= res["rss_target"]
    if not keep:
        shutil.rmtree(work)
    return res


def _cpu(step: dict) -> str:
    return f"user {step['user']['median']:.2f} s, kernel {step['kernel']['median']:.2f} s"


def main() -> None:
    global CACHE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["1b"],
                    choices=[*sorted(CONFIGS), "deepseek-v3"])
    ap.add_argument("--workers", default="auto")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds per model")
    cold = ap.add_mutually_exclusive_group()
    cold.add_argument("--cold", action="store_const", const="all", dest="cold", default="",
                      help="drop the whole page cache before every timed step (baseline and "
                      "subject alike; needs root)")
    cold.add_argument("--cold-source", action="store_const", const="source", dest="cold",
                      help="drop the source files' pages (posix_fadvise DONTNEED) before every "
                      "timed step")
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the generated checkpoints "
                    "and the runs' outputs go")
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exact comparison")
    ap.add_argument("--keep", action="store_true", help="keep the converted folders")
    ap.add_argument("--case", choices=["bf16", "fp8"], default="bf16", help="deepseek-v3: "
                    "bf16 round trip, or FP8 source -> bf16 mcore (256 experts)")
    ap.add_argument("--experts", type=int, default=None, help="deepseek-v3: routed experts "
                    "of the MoE layer (default 96 for bf16, 256 for fp8)")
    ap.add_argument("--work", type=Path, default=Path("/work/bench/dsv3"),
                    help="deepseek-v3: data folder (emptied at the end)")
    args = ap.parse_args()
    CACHE = args.cache
    CACHE.mkdir(parents=True, exist_ok=True)
    results = []
    gib = 2**30
    for name in args.models:
        if name == "deepseek-v3":
            import bench_convert_dsv3 as dsv3  # the scripts folder is on sys.path

            experts = args.experts or (256 if args.case == "fp8" else 96)
            results.append(dsv3.bench(args.case, experts, 8, args.repeats, args.workers,
                                      args.work))
            dsv3.report(results[-1])
            continue
        r = bench(name, args.workers, not args.no_check, args.keep, args.repeats, args.cold)
        results.append(r)
        state = {"all": "cold", "source": "source-cold", "": "warm"}[args.cold]
        print(f"\n{name} ({state} cache, {args.repeats} alternating "
              f"rounds, median (min, max)): HF {r['hf_bytes'] / gib:.2f} GiB, torch_dist "
              f"{r['mcore_bytes'] / gib:.2f} GiB, largest tensor {r['largest_tensor'] / gib:.2f}"
              f" GiB, RSS target {r['rss_target'] / gib:.2f} GiB")
        print(f"  cp -r HF:            {fmt(r['cp_hf']['seconds'])}  {_cpu(r['cp_hf'])}")
        for step, base in (("hf_to_mcore", "cp_hf"), ("mcore_to_hf", "cp_mcore")):
            s = r[step]
            if base == "cp_mcore":
                print(f"  cp -r torch_dist:    {fmt(r[base]['seconds'])}  {_cpu(r[base])}")
            label = "HF -> mcore tp2 pp2" if step == "hf_to_mcore" else "mcore -> HF"
            pr = s["pair_ratios"]
            print(f"  {label + ':':20s} {fmt(s['seconds'])}  {s['time_ratio']:.2f}x cp -r "
                  f"(per round {pr['min']:.2f}-{pr['max']:.2f}x)  peak RSS "
                  f"{s['peak_rss'] / gib:.2f} GiB ({'within' if s['rss_ok'] else 'ABOVE'} "
                  f"target)  {_cpu(s)}")
        print(f"  load average (1, 5, 15 min) before {r['load_before']}, after "
              f"{r['load_after']}")
        if "source_cached" in r:
            print("  source pages cached before HF -> mcore (fincore): "
                  + ", ".join(f"{x:.1%}" for x in r["source_cached"]))
        if "checked_tensors" in r:
            print(f"  round trip bit-exact: {r['checked_tensors']} tensors")
    tag = f"-deepseek-v3-{args.case}" if "deepseek-v3" in args.models else ""
    cold = {"all": "-cold", "source": "-cold-source"}.get(args.cold, "")
    out = CACHE / f"results{tag}{cold}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"\nresults: {out}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
