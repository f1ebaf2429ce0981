"""Trainer overhead: ``mdtk train``'s step time vs a bare megatron-core loop, same model and layout.

The bare loop is the least a megatron-core training step needs: megatron-core's
forward/backward schedule on the same chunks (built from the same HF checkpoint), one flat
all-reduce of the gradients over data parallel, megatron-core's grad-norm clipping and
``torch.optim.AdamW``; no DeepSpeed, no trainer. The trainer step is everything ``run`` does per
step (data pipeline, DeepSpeed ZeRO-1 engine, LR schedule, metrics line, memory gather, progress
bar), timed from one metrics line to the next. Both run in the same ranks, alternating rounds,
so machine load hits both alike; medians after warm-up steps are compared.

CPU part (always): 2 gloo ranks, a small Llama, layout dp2 or tp2.
GPU part (only with CUDA): a Llama-3.2-1B-sized model (random init) in bf16 on one GPU through the
trainer: tokens/s and MFU from metrics.jsonl, plus the same overhead comparison.

    python scripts/bench_train.py [--layout dp2|tp2] [--steps 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = "bundled:examples/data/pretrain.jsonl"
WARMUP = 3
CPU_MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=2048)
GPU_MODEL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                 tie_word_embeddings=True, rope_theta=500000.0)  # Llama-3.2-1B's shape


def make_assets(root: Path, model: dict, *, weights: bool) -> dict[str, str]:
    """Tokenizer + an HF Llama (saved weights on CPU; config only for the GPU pretrain run)."""
    import torch
    import transformers as tf

    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(root / "tokenizer")
    config = tf.LlamaConfig(**model, rms_norm_eps=1e-5, max_position_embeddings=4096,
                            eos_token_id=0, pad_token_id=1, bos_token_id=None)
    out = {"tokenizer": str(tok), "cache": str(root / "data_cache"), "root": str(root)}
    if weights:
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
        out["model"] = str(root / "model")
    else:
        config.architectures = ["LlamaForCausalLM"]  # what a hub config.json names
        config.save_pretrained(root / "model_config")
        out["config"] = str(root / "model_config" / "config.json")
    return out


def train_config(assets: dict[str, str], out: Path, *, layout: dict, steps: int, seq: int,
                 micro: int, global_batch: int, precision: str, zero: int = 1,
                 log_interval: int = 1, kernels: str = "auto"):
    from toolkit.train.config import config_from_dict

    model = ({"path": assets["model"], "tokenizer": assets["tokenizer"]} if "model" in assets
             else {"config": assets["config"], "tokenizer": assets["tokenizer"]})
    return config_from_dict({
        "output_dir": str(out), "model": model, "parallel": layout,
        "deepspeed": {"zero_stage": zero, "offload": "none"},
        "data": {"mode": "pretrain", "sources": [PRETRAIN], "validation_split": 0.0,
                 "cache_dir": assets["cache"]},
        "optim": {"lr": 1e-4, "decay": "constant", "clip_grad": 1.0},
        "train": {"steps": steps, "micro_batch": micro, "global_batch": global_batch,
                  "seq_len": seq, "precision": precision, "fused_kernels": kernels},
        "checkpoint": {"interval": 0, "resume": "none"},
        "logging": {"interval": log_interval},
    })


# -- the two loops (run on every rank) -------------------------------------------------------------

def trainer_steps(cfg) -> tuple[list[float], list[dict]]:
    """Seconds per step between consecutive metrics lines (rank 0; [] elsewhere; a line every
    ``logging.interval`` steps) and the metrics rows."""
    from toolkit.train import trainer

    stamps: list[float] = []

    class Timed(trainer.MetricsWriter):
        def log(self, m):
            super().log(m)
            stamps.append(time.perf_counter())

    original = trainer.MetricsWriter
    trainer.MetricsWriter = Timed
    try:
        trainer.run(cfg)
    finally:
        trainer.MetricsWriter = original
    rows = []
    metrics = Path(str(cfg.output_dir)) / "metrics.jsonl"
    if stamps:
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    every = cfg.logging.interval
    return [(b - a) / every for a, b in zip(stamps, stamps[1:], strict=False)], rows


def bare_steps(cfg) -> list[float]:
    """Per-step seconds of megatron-core schedule + flat dp all-reduce + clip + torch AdamW."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from toolkit import parallel, runtime
    from toolkit.parallel.grads import finalize_grads
    from toolkit.train import config as cfgmod
    from toolkit.train.loop.engine import mark_tensor_parallel_params
    from toolkit.train.model import RunModel, build_model

    run_plan = cfgmod.plan(cfg, dist.get_world_size())
    parallel.initialize(run_plan.layout, seed=cfg.train.seed)
    try:
        chunks, _ = build_model(cfg, run_plan.layout, RunModel.of(cfg))
        device = runtime.device()
        for c in chunks:
            c.to(device)
        mark_tensor_parallel_params(chunks)
        params = [p for c in chunks for p in c.parameters()]
        # bf16/fp16 params get fp32 master weights, as any mixed-precision optimizer keeps
        # (DeepSpeed's included): comparing against AdamW on bf16 weights would flatter the bare
        # loop with less work and worse numerics.
        mixed = params[0].dtype != torch.float32
        master = [p.detach().float().requires_grad_() for p in params] if mixed else params
        opt = torch.optim.AdamW(master, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                weight_decay=cfg.optim.weight_decay, eps=cfg.optim.eps,
                                fused=runtime.use_cuda() or None)
        mb, seq, n = run_plan.micro_batch, cfg.train.seq_len, run_plan.grad_accum
        gen = torch.Generator().manual_seed(1)
        dp_group = ps.get_data_parallel_group()
        tp_rank = ps.get_tensor_model_parallel_rank()
        forward_backward = get_forward_backward_func()

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            pos = torch.arange(seq, device=device).unsqueeze(0).expand_as(tokens)
            if getattr(model, "linear_ce_vocab", None):  # the run's fused linear loss: a sum
                out = model(tokens, pos, None, labels=labels, loss_mask=torch.ones_like(labels))
                return out, lambda total: (total.float() / labels.numel(), {})
            out = model(tokens, pos, None, labels=labels)
            return out, lambda per_token: (per_token.float().mean(), {})

        times = []
        for _ in range(cfg.train.steps):
            t0 = time.perf_counter()
            batches = [(torch.randint(0, 500, (mb, seq), generator=gen).to(device),
                        torch.randint(0, 500, (mb, seq), generator=gen).to(device))
                       for _ in range(n)]
            opt.zero_grad(set_to_none=False)
            forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                             model=chunks[0], num_microbatches=n, seq_length=seq,
                             micro_batch_size=mb, forward_only=False)
            finalize_grads(chunks)
            _reduce_and_clip(params, dp_group, tp_rank, cfg.optim.clip_grad)
            if mixed:
                for m, p in zip(master, params, strict=True):
                    m.grad = None if p.grad is None else p.grad.float()
            opt.step()
            if mixed:
                with torch.no_grad():
                    torch._foreach_copy_(params, master)
            if runtime.use_cuda():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times
    finally:
        parallel.destroy()


def _reduce_and_clip(params, dp_group, tp_rank: int, clip: float) -> None:
    """The bare loop's gradient reduction: one flat all-reduce over data parallel (averaged),
    then megatron-core's grad norm and clipping by the total norm."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    grads = [p.grad for p in params if p.grad is not None]
    if dist.get_world_size(dp_group) > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_group)
        flat /= dist.get_world_size(dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    norm_grads = [p.grad for p in params if p.grad is not None and (
        tp_rank == 0 or getattr(p, "tensor_model_parallel", False))]
    norm = get_grad_norm_fp32(norm_grads, grad_stats_parallel_group=ps.get_model_parallel_group())
    coeff = clip / (norm + 1e-6)
    if coeff < 1.0:  # megatron-core's clip_grad_by_total_norm_fp32 (CUDA-only assert)
        torch._foreach_mul_(grads, coeff)


def compare(assets: dict[str, str], opts: dict) -> dict:
    """Alternate bare and trainer rounds; per-step times after warm-up (rank 0's view)."""
    import torch.distributed as dist

    from toolkit import runtime

    runtime.enable_cpu_mode()
    runtime.init_distributed()
    bare, trained, rows = [], [], []
    for r in range(opts["rounds"]):
        cfg = train_config(assets, Path(assets["root"]) / f"run{r}", **opts["train"])
        bare += bare_steps(cfg)[WARMUP:]
        steps, rows = trainer_steps(cfg)
        every = cfg.logging.interval  # intervals start after the first line: skip the warm-up
        trained += steps[max(-(-(WARMUP - every) // every), 0):]
    return {"rank": dist.get_rank(), "bare": bare, "trainer": trained, "rows": rows}


def profile_trainer(assets: dict[str, str], opts: dict) -> str:
    """torch.profiler over a short trainer run: the ops that cost the most, device and host."""
    from torch.profiler import ProfilerActivity, profile

    from toolkit import runtime

    runtime.enable_cpu_mode()
    runtime.init_distributed()
    cfg = train_config(assets, Path(assets["root"]) / "profile", **opts["train"])
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runtime.use_cuda() else [])
    with profile(activities=acts) as prof:
        trainer_steps(cfg)
    key = "self_cuda_time_total" if runtime.use_cuda() else "self_cpu_time_total"
    averages = prof.key_averages()
    return (averages.table(sort_by=key, row_limit=25)
            + averages.table(sort_by="cpu_time_total", row_limit=25))


def summarize(res: dict) -> dict:
    b, t = statistics.median(res["bare"]), statistics.median(res["trainer"])
    out = {"bare_s": b, "trainer_s": t, "overhead_pct": 100.0 * (t - b) / b,
           "samples": (len(res["bare"]), len(res["trainer"]))}
    rows = [r for r in res["rows"] if r["step"] > WARMUP]
    if rows:  # step_time_s: train_step alone (schedule + DeepSpeed), without the loop around it
        out["train_step_s"] = statistics.median(r["step_time_s"] for r in rows)
        out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in rows)
        mfus = [r["mfu"] for r in rows if r.get("mfu") is not None]
        out["mfu"] = statistics.median(mfus) if mfus else None
        out["tflops_per_device"] = statistics.median(
            r["tflops_per_device"] for r in rows if r.get("tflops_per_device") is not None
        ) if mfus else None
    return out


def on_cpu_ranks(fn, args, *, prefix: str) -> list:
    """``fn(assets, opts)`` on 2 gloo ranks over a small Llama (a temporary folder); ``opts``:
    ``args``' rounds and trainer settings (layout, steps). Returns the per-rank results."""
    from toolkit.runtime.rankpool import RankPool

    layout = {"dp2": {"tp": 1}, "tp2": {"tp": 2}}[args.layout]
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        assets = make_assets(Path(tmp), CPU_MODEL, weights=True)
        opts = {"rounds": args.rounds, "train": dict(layout=layout, steps=args.steps, seq=128,
                                                     micro=4, global_batch=8, precision="fp32",
                                                     zero=args.zero,
                                                     log_interval=args.log_interval)}
        with RankPool(2) as pool:
            if getattr(args, "profile", False):
                print(pool.run(profile_trainer, assets, opts, timeout=3600)[0])
            return pool.run(fn, assets, opts, timeout=3600)


def cpu_part(args) -> dict:
    return summarize(on_cpu_ranks(compare, args, prefix="bench_train_")[0])


def one_gpu(port: int) -> str | None:
    """Set up this process as the one rank of a GPU run; why not, when CUDA is missing."""
    import torch

    if not torch.cuda.is_available():
        return "skipped: CUDA is not available on this machine (torch.cuda.is_available() is False)"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                 ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    return None


def gpu_part(args) -> dict | str:
    import torch

    if (why := one_gpu(29531)) is not None:
        return why
    with tempfile.TemporaryDirectory(prefix="bench_train_gpu_") as tmp:
        assets = make_assets(Path(tmp), GPU_MODEL, weights=False)
        opts = {"rounds": 1, "train": dict(layout={"tp": 1}, steps=args.gpu_steps,
                                           seq=args.gpu_seq, micro=args.gpu_micro,
                                           global_batch=args.gpu_micro * args.gpu_accum,
                                           precision="bf16", zero=args.zero,
                                           log_interval=args.gpu_log_interval,
                                           kernels=args.gpu_kernels)}
        if args.profile:
            print(profile_trainer(assets, opts))
        torch.cuda.reset_peak_memory_stats()
        out = summarize(compare(assets, opts))
        out.update(device=torch.cuda.get_device_name(), model=GPU_MODEL, seq=args.gpu_seq,
                   micro_batch=args.gpu_micro, accumulation=args.gpu_accum, zero=args.zero,
                   kernels=args.gpu_kernels, log_interval=args.gpu_log_interval,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=("dp2", "tp2"), default="dp2")
    p.add_argument("--steps", type=int, default=20, help="steps per round (CPU part)")
    p.add_argument("--rounds", type=int, default=2, help="alternating bare/trainer rounds")
    p.add_argument("--gpu-steps", type=int, default=20)
    p.add_argument("--gpu-seq", type=int, default=2048)
    p.add_argument("--gpu-micro", type=int, default=8)
    p.add_argument("--gpu-accum", type=int, default=1,
                   help="micro-batches per step (gradient accumulation); the optimizer's fixed "
                        "cost per step is shared by this many micro-batches")
    p.add_argument("--zero", type=int, choices=(0, 1, 2), default=1,
                   help="the trainer's ZeRO stage (the bare loop is plain data parallelism, "
                        "ZeRO-0's semantics: 0 compares like with like)")
    p.add_argument("--log-interval", type=int, default=1,
                   help="the trainer's logging.interval (CPU part): its step values are read "
                        "every this many steps")
    p.add_argument("--gpu-log-interval", type=int, default=4, help="logging.interval (GPU)")
    p.add_argument("--gpu-kernels", default="auto",
                   help="the trainer's train.fused_kernels on the GPU (auto, off, or a list)")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler tables of a trainer run first (rank 0)")
    p.add_argument("--json", type=Path, help="also write the figures here (scripts/gpu_check.py)")
    args = p.parse_args()
    figures: dict = {}
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))
    if not args.skip_cpu:
        cpu = figures["cpu"] = cpu_part(args)
        print(f"CPU, 2 gloo ranks, {args.layout}, Llama h={CPU_MODEL['hidden_size']} "
              f"L={CPU_MODEL['num_hidden_layers']} seq 128, global batch 8, fp32: "
              f"bare megatron-core {cpu['bare_s'] * 1e3:.1f} ms/step, trainer "
              f"{cpu['trainer_s'] * 1e3:.1f} ms/step (metrics step_time_s "
              f"{cpu['train_step_s'] * 1e3:.1f} ms), ZeRO-{args.zero}, logging interval "
              f"{args.log_interval}: overhead {cpu['overhead_pct']:+.1f}% "
              f"(goal <= 5%; medians of {cpu['samples'][0]} / {cpu['samples'][1]} steps)")
    gpu = figures["gpu"] = gpu_part(args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if isinstance(gpu, str):
        print(f"GPU part {gpu}")
    else:
        mfu = f"{gpu['mfu'] * 100:.1f}%" if gpu.get("mfu") is not None else "n/a"
        print(f"GPU, 1 device, Llama-3.2-1B-sized, bf16, seq {args.gpu_seq}, micro "
              f"{args.gpu_micro} x {args.gpu_accum} accumulation: trainer "
              f"{gpu['tokens_per_s']:.0f} tokens/s, MFU {mfu}; "
              f"bare {gpu['bare_s'] * 1e3:.1f} ms/step, trainer {gpu['trainer_s'] * 1e3:.1f} "
              f"ms/step, overhead {gpu['overhead_pct']:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
