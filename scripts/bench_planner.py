"""The planner's ranking against measured step times: the top plans for a small Llama on CPU
ranks, each trained by ``mdtk train`` from the config ``mdtk plan --emit`` would write.

1. On the ranks, measure the machine the cost model needs: fp32 matmul FLOP/s, memory
   bandwidth, gloo all-reduce latency and bandwidth (the cost model's device, efficiencies 1).
2. Plan the model for that device and take ``--plans`` plans spread evenly over the ``--pool``
   fastest (#1 always; every ZeRO stage, offload, recompute and layout the search keeps, best
   micro-batch each), so the ranking is tested over a range of predicted times.
3. Train each plan for ``--steps`` steps (trainer YAML + DeepSpeed JSON as emitted) and take
   the median ``step_time_s`` after the warm-up.
4. Print predicted vs measured and the rank correlation (Spearman's rho, Kendall's tau).

    python scripts/bench_planner.py [--world 2] [--plans 8] [--pool 32] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train import CPU_MODEL, PRETRAIN, make_assets  # noqa: E402

WARMUP = 3
SEQ, GLOBAL = 128, 16


def measure_machine() -> dict[str, float]:
    """Per-rank achieved numbers, all ranks at once (so they share the machine as in training)."""
    import torch
    import torch.distributed as dist

    from toolkit import runtime

    runtime.enable_cpu_mode()
    runtime.init_distributed()
    h, f = CPU_MODEL["hidden_size"], CPU_MODEL["intermediate_size"]
    a, b = torch.randn(4 * SEQ, h), torch.randn(h, f)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    reps = 30
    for _ in range(reps):
        a @ b
    flops = reps * 2 * a.shape[0] * h * f / (time.perf_counter() - t0)
    x, y = torch.randn(4 * 2**20), torch.empty(4 * 2**20)
    torch.mul(x, 2.0, out=y)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mul(x, 2.0, out=y)  # reads and writes 16 MiB
    mem = 20 * 2 * x.numel() * 4 / (time.perf_counter() - t0)
    n = dist.get_world_size()
    small, big = torch.zeros(1), torch.zeros(4 * 2**20)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(small)
    latency = (time.perf_counter() - t0) / 50
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(big)
    t_big = (time.perf_counter() - t0) / 5
    bus = 2 * (n - 1) / n * big.numel() * 4 / max(t_big - latency, 1e-9)
    return {"flops": flops, "mem": mem, "latency": latency, "bus": bus}


def train_plans(configs: list[str]) -> list[dict]:
    """Median ``step_time_s`` after warm-up of each emitted config (every rank reports)."""
    import json

    from toolkit.train import trainer
    from toolkit.train.config import load_config

    out = []
    for path in configs:
        cfg = load_config(path)
        trainer.run(cfg)
        rows = [json.loads(line) for line in
                (Path(str(cfg.output_dir)) / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in rows[WARMUP:] if r.get("step_time_s")]
        out.append({"config": path, "step_s": statistics.median(times) if times else None})
    return out


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties averaged."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy)


def kendall(x: list[float], y: list[float]) -> float:
    pairs = [(i, j) for i in range(len(x)) for j in range(i + 1, len(x))]
    s = sum((x[i] - x[j]) * (y[i] - y[j]) > 0 for i, j in pairs)
    d = sum((x[i] - x[j]) * (y[i] - y[j]) < 0 for i, j in pairs)
    return (s - d) / len(pairs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="CPU ranks")
    p.add_argument("--plans", type=int, default=8, help="how many plans to run")
    p.add_argument("--pool", type=int, default=32, help="spread them over this many best plans")
    p.add_argument("--steps", type=int, default=8, help=f"steps per plan ({WARMUP} warm-up)")
    args = p.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))
    import yaml

    from toolkit.atomic import write_text
    from toolkit.dsconfig import write_json
    from toolkit.memory import GIB, Cluster, load_model_shape
    from toolkit.planner import Efficiency, Workload, get_device, search
    from toolkit.planner.emit import RunSpec, deepspeed_json, trainer_yaml
    from toolkit.planner.search import Budget
    from toolkit.runtime import ops
    from toolkit.runtime.rankpool import RankPool

    ops.prebuild()
    with tempfile.TemporaryDirectory(prefix="bench_planner_") as tmp:
        assets = make_assets(Path(tmp), CPU_MODEL, weights=True)
        with RankPool(args.world) as pool:
            machine = pool.run(measure_machine, timeout=600)
            m = {k: statistics.median(r[k] for r in machine) for k in machine[0]}
            device = get_device("cpu", fp32_tflops=m["flops"] / 1e12,
                                bf16_tflops=m["flops"] / 1e12, hbm=m["mem"], pcie=m["mem"],
                                host_mem=m["mem"] * args.world, intra=m["bus"], inter=m["bus"],
                                latency_intra=m["latency"], latency_inter=m["latency"])
            eff = Efficiency(matmul=1.0, attention=1.0, memory=1.0, network=1.0, pcie=1.0,
                             host=1.0)
            shape = load_model_shape(assets["model"])
            cluster = Cluster(1, args.world, 4 * GIB, 32 * GIB)
            work = Workload(SEQ, GLOBAL, "fp32", flash=False, fused=False)
            budget = Budget()
            result = search(shape, work, cluster, device, top=max(args.pool, args.plans),
                            eff=eff, budget=budget)
            pool_plans = result.plans
            step = (len(pool_plans) - 1) / max(1, args.plans - 1)
            chosen = sorted({round(i * step) for i in range(min(args.plans, len(pool_plans)))})
            plans = [pool_plans[i] for i in chosen]
            configs = []
            for i, plan in enumerate(plans):
                folder = Path(tmp) / f"plan{i}"
                ds, _ = deepspeed_json(shape, work, plan, cluster, budget)
                write_json(folder / "ds_config.json", ds)
                run = RunSpec(output_dir=str(folder / "run"), model_path=assets["model"],
                              tokenizer=assets["tokenizer"], data=(PRETRAIN,),
                              steps=args.steps, lr=1e-4)
                raw = trainer_yaml(plan, work, run, str(folder / "ds_config.json"))
                write_text(folder / "train.yaml", yaml.safe_dump(raw, sort_keys=False))
                configs.append(str(folder / "train.yaml"))
            measured = pool.run(train_plans, configs, timeout=7200)
    predicted = [pl.cost.step for pl in plans]
    got = [max(r[i]["step_s"] for r in measured) for i in range(len(configs))]
    print(f"machine ({args.world} gloo ranks, 1 thread each): {m['flops'] / 1e9:.1f} GFLOP/s "
          f"matmul, {m['mem'] / 1e9:.1f} GB/s memory, all-reduce {m['latency'] * 1e6:.0f} us + "
          f"{m['bus'] / 1e9:.2f} GB/s bus")
    print(f"Llama h={CPU_MODEL['hidden_size']} L={CPU_MODEL['num_hidden_layers']} vocab "
          f"{CPU_MODEL['vocab_size']}, seq {SEQ}, global batch {GLOBAL}, fp32, {args.steps} "
          f"steps ({WARMUP} warm-up)")
    print("| planner rank | plan | predicted ms | measured ms | measured / predicted |")
    print("| --- | --- | --- | --- | --- |")
    for i, pl, pr, me in zip(chosen, plans, predicted, got, strict=True):
        print(f"| {i + 1} | {pl.candidate.describe()} | {pr * 1e3:.1f} | {me * 1e3:.1f} | "
              f"{me / pr:.2f} |")
    print(f"rank correlation (measured vs predicted step time): Spearman rho = "
          f"{spearman(predicted, got):+.2f}, Kendall tau = {kendall(predicted, got):+.2f} "
          f"over {len(got)} plans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
