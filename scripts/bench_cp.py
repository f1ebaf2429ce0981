"""Context parallelism on CPU: tokens/s and peak memory per rank at cp1 vs cp2, one long sequence.

Two gloo ranks (one torch thread each, so both layouts use the same 2 cores). cp1 is dp2: each
rank trains on its own whole sequence; cp2: both ranks share one sequence (each its two
load-balanced chunks, K/V all-gathered). Tokens/s counts the tokens both ranks process per
second (cp1: 2 x seq per step; cp2: seq per step). Per rank: the activation bytes autograd saves
in one forward (saved-tensor hooks), the memory model's prediction of them, and the process's
peak RSS during the timed steps (VmHWM, reset through /proc/self/clear_refs before them), whole
and above the RSS before them. Both layouts use SDPA core attention (the CP attention runs the
same CPU flash kernel), a tiny-width Llama-like model, fp32, forward + backward, no optimizer.
Rounds alternate cp1 and cp2 in the same ranks, so machine load hits both alike; the median and
the spread (min-max) over rounds are printed.

    python scripts/bench_cp.py [--seq 4096] [--rounds 4] [--steps 2] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(hidden=128, heads=4, kv_heads=2, ffn=256, vocab=256)


def _peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _status(key: str) -> int:
    """Bytes of a /proc/self/status line (VmHWM: peak RSS, VmRSS: now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _model(cp: int, seq: int, layers: int):
    import torch.nn.functional as F

    from toolkit.models import build_chunks, layer_spec, transformer_config

    m = MODEL
    config = transformer_config(
        num_layers=layers, hidden_size=m["hidden"], num_attention_heads=m["heads"],
        num_query_groups=m["kv_heads"], ffn_hidden_size=m["ffn"], normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, context_parallel_size=cp,
        params_dtype=torch.float32, pipeline_dtype=torch.float32)
    (model,) = build_chunks(config, layer_spec(normalization="RMSNorm", attention="sdpa"),
                            vocab_size=m["vocab"], max_sequence_length=seq,
                            position_embedding_type="rope",
                            share_embeddings_and_output_weights=False)
    return model.train()


def _predicted(cp: int, seq: int, layers: int) -> float:
    """The memory model's saved bytes of one forward of this model on one rank (SDPA at cp1,
    megatron-core's unfused CPU kernels otherwise)."""
    from toolkit.memory import ModelShape, TrainShape
    from toolkit.memory.activations import forward_saved_bytes
    from toolkit.parallel import ParallelLayout

    m = MODEL
    shape = ModelShape(hidden=m["hidden"], layers=layers, heads=m["heads"],
                       kv_heads=m["kv_heads"], head_dim=m["hidden"] // m["heads"], ffn=m["ffn"],
                       vocab=m["vocab"], gated_mlp=True, norm="rms")
    train = TrainShape(seq_len=seq, micro_batch=1, dtype="fp32", flash_attention=True,
                       fused=False)
    return forward_saved_bytes(shape, train, ParallelLayout(cp=cp).resolve(cp))


def _run(cp: int, seq: int, steps: int, layers: int) -> dict[str, float]:
    """One layout: this rank's seconds per step (median of ``steps``), saved bytes, peak RSS."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from toolkit import parallel
    from toolkit.parallel import ParallelLayout

    parallel.initialize(ParallelLayout(cp=cp), seed=1234)
    try:
        model = _model(cp, seq, layers)
        gen = torch.Generator().manual_seed(dist.get_rank() if cp == 1 else 0)
        tokens = torch.randint(0, MODEL["vocab"], (1, seq), generator=gen)
        pos = torch.arange(seq).unsqueeze(0)
        if cp > 1:
            cut = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": pos})
            tokens, pos = cut["tokens"], cut["position_ids"]
        saved: dict[int, int] = {}
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                saved[st.data_ptr()] = max(saved.get(st.data_ptr(), 0), st.nbytes())
            return t

        def step(hooks: bool) -> float:
            dist.barrier()
            start = time.perf_counter()
            if hooks:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = model(tokens, pos, None, labels=tokens)
            else:
                loss = model(tokens, pos, None, labels=tokens)
            loss.float().mean().backward()
            model.zero_grad(set_to_none=True)
            dist.barrier()
            return time.perf_counter() - start

        step(hooks=True)  # warm-up, and the saved bytes
        _peak_rss_reset()
        before = _status("VmRSS")
        times = [step(hooks=False) for _ in range(steps)]
        peak = _status("VmHWM")
        return {"s_per_step": statistics.median(times), "saved_bytes": sum(saved.values()),
                "peak_rss": peak, "step_peak": peak - before}
    finally:
        parallel.destroy()


def _rank(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    rows = []
    for r in range(args.rounds):
        for cp in (1, 2) if r % 2 == 0 else (2, 1):
            res = _run(cp, args.seq, args.steps, args.layers)
            rows.append({"round": r, "cp": cp, "rank": rank, **res})
    gathered = [None, None]
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out).write_text(json.dumps([x for g in gathered for x in g]))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import tempfile

    import torch.multiprocessing as mp

    from toolkit.runtime.ports import free_port

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(_rank, args=(args, free_port(), out), nprocs=2, join=True)
        rows = json.loads(Path(out).read_text())
    load_after = os.getloadavg()
    print(f"seq {args.seq}, {args.layers} layers, hidden {MODEL['hidden']}, heads "
          f"{MODEL['heads']}/{MODEL['kv_heads']}, ffn {MODEL['ffn']}, fp32, 2 gloo ranks x 1 "
          f"thread, {args.rounds} rounds x {args.steps} timed steps (fwd+bwd)")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after "
          f"{load_after[0]:.2f} {load_after[1]:.2f}")
    for cp in (1, 2):
        per_round = {}
        for row in rows:
            if row["cp"] == cp:
                per_round.setdefault(row["round"], []).append(row)
        tokens = args.seq * (2 if cp == 1 else 1)  # both ranks together, per step
        tps = [tokens / max(x["s_per_step"] for x in rr) for rr in per_round.values()]
        saved = [x["saved_bytes"] for rr in per_round.values() for x in rr]
        rss = [x["peak_rss"] for rr in per_round.values() for x in rr]
        grow = [x["step_peak"] for rr in per_round.values() for x in rr]
        model = _predicted(cp, args.seq, args.layers)
        print(f"cp{cp}: tokens/s median {statistics.median(tps):8.1f} (min {min(tps):.1f}, max "
              f"{max(tps):.1f}); per rank: activations {max(saved) / 2**20:7.1f} MiB (memory model "
              f"{model / 2**20:.1f} MiB, {100 * (model / max(saved) - 1):+.1f}%), peak RSS "
              f"median {statistics.median(rss) / 2**20:7.1f} MiB (min {min(rss) / 2**20:.1f}, "
              f"max {max(rss) / 2**20:.1f}), of it above the pre-step RSS median "
              f"{statistics.median(grow) / 2**20:.1f} MiB (min {min(grow) / 2**20:.1f}, max "
              f"{max(grow) / 2**20:.1f})")


if __name__ == "__main__":
    main()
