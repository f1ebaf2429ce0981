"""LoRA vs full fine-tuning with ``mdtk train``: step time and memory per rank, same layout.

Both runs use the same model, data, layout and DeepSpeed settings; only ``peft.method`` differs.
They alternate for several rounds in the same ranks, so machine load hits both alike; the
figures are medians after warm-up steps, with the spread (min..max) over rounds. Memory per
rank: the bytes the DeepSpeed engine holds for parameters, gradients and optimizer states
(counted before the second update, every storage once) and the process's peak memory during
the run (reset before each run, after collecting the previous run's objects: peak RSS on CPU,
CUDA's peak allocation above what was still allocated at the run's start on a GPU; that start
is reported as ``start_bytes``).

CPU part (always): 2 gloo ranks, a small Llama, dp2 ZeRO-1 or tp2, fp32.
GPU part (only with CUDA): Llama-3.2-1B's widths with 8 layers and a 32k vocab (0.5B) in bf16
on one GPU (fine-tuning needs saved weights: a smaller model keeps the save short).

    python scripts/bench_lora.py [--layout dp2|tp2] [--steps 8] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_train import (  # noqa: E402
    CPU_MODEL,
    GPU_MODEL,
    make_assets,
    on_cpu_ranks,
    one_gpu,
    train_config,
)

WARMUP = 2
GPU_LORA_MODEL = {**GPU_MODEL, "num_hidden_layers": 8, "vocab_size": 32000}
LORA = {"method": "lora", "r": 16, "alpha": 32}


def _reset_peak() -> int:
    """Start this process's peak-memory count afresh (runs alternate in the same ranks); the
    bytes still allocated from before (CUDA; 0 on CPU). The previous run's engine is collected
    first: it sits in reference cycles (DeepSpeed's, and ``one_run``'s step spy), and on the
    H100 (2026-11-26) its 8.8 GB counted in the next (LoRA) run's peak: 1.07x full's."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM restarts from the current RSS
    return 0


def _peak(start: int = 0) -> int:
    """This process's peak memory since ``_reset_peak``: CUDA allocated above what was still
    allocated at the reset (``start``), or RSS on CPU."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()) - start
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def one_run(cfg) -> dict:
    """``trainer.run`` with the engine's model-state bytes counted before its second update, and
    the process's peak memory during the run."""
    from dist_checks import lora_checks

    from toolkit.train import trainer

    seen: dict = {}
    original = trainer.build_engine

    def spy(*args, **kwargs):
        engine = original(*args, **kwargs)
        lora_checks.measure_engine(engine, seen)  # before the 2nd update: Adam states exist
        return engine

    trainer.build_engine = spy
    start = _reset_peak()
    try:
        trainer.run(cfg)
    finally:
        trainer.build_engine = original
    rows = []
    metrics = Path(str(cfg.output_dir)) / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()][WARMUP:]
    return {**seen, "step_s": [r["step_time_s"] for r in rows], "peak": _peak(start),
            "start_bytes": start}


def compare(assets: dict, opts: dict) -> dict:
    """Alternating rounds of full and LoRA runs (every rank); per-round medians on rank 0."""
    from toolkit.train.config import apply_overrides, config_from_dict

    rounds: dict[str, list[dict]] = {"full": [], "lora": []}
    for i in range(opts["rounds"]):
        for mode in ("full", "lora"):
            cfg = train_config(assets, Path(assets["root"]) / f"{mode}{i}", **opts["train"])
            if mode == "lora":
                cfg = config_from_dict(apply_overrides(cfg.to_dict(), [
                    f"peft.{k}={v}" for k, v in LORA.items()]))
            rounds[mode].append(one_run(cfg))
    return rounds


def summarize(rounds: dict) -> dict:
    def med(mode: str, key: str) -> list[float]:
        return [statistics.median(r[key]) if isinstance(r[key], list) else r[key]
                for r in rounds[mode]]

    out: dict = {}
    for key in ("step_s", "held_bytes", "peak", "trainable"):
        full, lora = med("full", key), med("lora", key)
        ratios = [b / a for a, b in zip(full, lora, strict=True)]
        out[key] = {"full": statistics.median(full), "lora": statistics.median(lora),
                    "lora_over_full": statistics.median(ratios),
                    "spread": [min(ratios), max(ratios)]}
    out["start_bytes"] = {m: max(r["start_bytes"] for r in rounds[m]) for m in rounds}
    out["rounds"] = len(rounds["full"])
    return out


def cpu_part(args) -> dict:
    per_rank = on_cpu_ranks(compare, args, prefix="bench_lora_")
    return {"layout": args.layout, "model": CPU_MODEL, **summarize(per_rank[0])}


def gpu_part(args) -> dict | str:
    import torch

    if (why := one_gpu(29533)) is not None:
        return why
    with tempfile.TemporaryDirectory(prefix="bench_lora_gpu_") as tmp:
        assets = make_assets(Path(tmp), GPU_LORA_MODEL, weights=True)
        opts = {"rounds": args.gpu_rounds, "train": dict(
            layout={"tp": 1}, steps=args.gpu_steps, seq=args.gpu_seq, micro=args.gpu_micro,
            global_batch=args.gpu_micro, precision="bf16")}
        out = summarize(compare(assets, opts))
        out.update(device=torch.cuda.get_device_name(), model=GPU_LORA_MODEL, seq=args.gpu_seq,
                   micro_batch=args.gpu_micro)
        return out


def _print(title: str, res: dict) -> None:
    print(f"\n{title}: LoRA r={LORA['r']} / full fine-tuning, median of {res['rounds']} "
          "alternating rounds (spread min..max)")
    names = {"step_s": "step time (s)", "held_bytes": "engine state bytes / rank",
             "peak": "peak memory / rank", "trainable": "trainable params / rank"}
    for key, label in names.items():
        r = res[key]
        print(f"  {label:28s} full {r['full']:>14,.3f}  lora {r['lora']:>14,.3f}  "
              f"ratio {r['lora_over_full']:.4f} ({r['spread'][0]:.4f}..{r['spread'][1]:.4f})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=("dp2", "tp2"), default="dp2")
    p.add_argument("--steps", type=int, default=8, help="steps per run (CPU part)")
    p.add_argument("--rounds", type=int, default=3, help="alternating full/LoRA rounds")
    p.add_argument("--gpu-steps", type=int, default=8)
    p.add_argument("--gpu-rounds", type=int, default=1)
    p.add_argument("--gpu-seq", type=int, default=2048)
    p.add_argument("--gpu-micro", type=int, default=4)
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--json", type=Path, help="also write the figures here (scripts/gpu_check.py)")
    args = p.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))
    figures: dict = {}
    if not args.skip_cpu:
        figures["cpu"] = cpu_part(args)
        _print(f"CPU, 2 ranks, {args.layout}", figures["cpu"])
    gpu = gpu_part(args)
    figures["gpu"] = gpu
    if isinstance(gpu, dict):
        _print(f"GPU, {gpu['device']}", gpu)
    else:
        print(f"\nGPU: {gpu}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
