"""The fused kernels of ``train.fused_kernels`` (toolkit/models/kernels.py) against the unfused
ops they replace, one at a time, at a Llama-3.2-1B micro-batch (2 x 4096 tokens, hidden 2048,
FFN 8192, vocab 128256, bf16) on one GPU: forward + backward time (median of alternating rounds,
and its spread), peak memory above the inputs, and the error against an fp32 computation.

- SwiGLU on the fc1 output [4096, 2, 16384]: chunk + silu * up (the local spec) vs megatron-core's
  fused ``bias_swiglu_impl`` (torch.compile'd) vs Liger's ``LigerSiLUMulFunction``;
- the loss of hidden states [4096, 2, 2048]: the output matmul + megatron-core's
  ``vocab_parallel_cross_entropy`` (logits materialised; the local spec) vs the same with
  megatron-core's fused cross-entropy vs Liger's fused linear cross-entropy (sum reduction,
  gradients computed in the forward, logits never materialised);
- RMSNorm: torch's ``rms_norm`` (one fused kernel on CUDA; what the local spec uses) vs Liger's.

    python scripts/bench_kernels.py [--rounds 7] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from bench_measure import report  # beside this file

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH, HIDDEN, FFN, VOCAB = 4096, 2, 2048, 8192, 128256


def _time(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync()
    start.record()
    fn()
    end.record()
    sync()
    return start.elapsed_time(end) / 1e3


def _run(name: str, fn: Callable[[], tuple], ref: tuple) -> tuple[Callable[[], None], dict]:
    """A timed closure (forward + backward) and its error / peak memory figures."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    peak = torch.cuda.max_memory_allocated() - base
    errors = [((o.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
              for o, r in zip(out, ref, strict=True)]
    return (lambda: fn()), {"peak_gib": peak / 2**30, "max_rel_error": max(errors)}


def swiglu_cases():
    import torch
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(SEQ, BATCH, 2 * FFN, device="cuda", generator=g, dtype=torch.bfloat16)
    dout = torch.randn(SEQ, BATCH, FFN, device="cuda", generator=g, dtype=torch.bfloat16)

    def run(f, dtype=torch.bfloat16):
        x = y.to(dtype).detach().requires_grad_()
        out = f(x)
        out.backward(dout.to(dtype))
        return out.detach(), x.grad

    def unfused(x):
        a, b = torch.chunk(x, 2, dim=-1)
        return F.silu(a) * b

    def liger(x):
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        a, b = torch.chunk(x, 2, dim=-1)
        return LigerSiLUMulFunction.apply(a, b)

    ref = run(unfused, torch.float32)
    return ref, {"local spec (chunk, silu, mul)": lambda: run(unfused),
                 "megatron-core bias_swiglu_impl": lambda: run(lambda x: bias_swiglu_impl(
                     x, None)),
                 "Liger SiLUMul": lambda: run(liger)}


def loss_cases():
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from toolkit.models.gpt import linear_cross_entropy_sum

    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = 0.02 * torch.randn(VOCAB, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    mask = torch.ones(BATCH, SEQ, device="cuda")

    def run(loss_of, dtype=torch.bfloat16):
        h = hidden.to(dtype).detach().requires_grad_()
        w = weight.to(dtype).detach().requires_grad_()
        loss = loss_of(h, w)
        loss.backward()
        return loss.detach().reshape(1), h.grad, w.grad

    def materialised(ce):
        def loss_of(h, w):
            logits = h @ w.t()
            return ce(logits, labels.t().contiguous()).sum()
        return loss_of

    tp = ps.get_tensor_model_parallel_group()
    ref = run(materialised(vocab_parallel_cross_entropy), torch.float32)
    return ref, {
        "local spec (logits + vocab_parallel_cross_entropy)": lambda: run(
            materialised(vocab_parallel_cross_entropy)),
        "megatron-core fused cross-entropy": lambda: run(materialised(
            lambda x, y: fused_vocab_parallel_cross_entropy(x, y, tp))),
        "Liger fused linear cross-entropy": lambda: run(
            lambda h, w: linear_cross_entropy_sum(h, w, labels, mask)),
    }


def norm_cases():
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(2)
    x0 = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    w0 = 1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16)
    dout = torch.randn_like(x0)

    def run(f, dtype=torch.bfloat16):
        x, w = (t.to(dtype).detach().requires_grad_() for t in (x0, w0))
        out = f(x, w)
        out.backward(dout.to(dtype))
        return out.detach(), x.grad, w.grad

    def liger(x, w):
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return LigerRMSNormFunction.apply(x, w, 1e-5)

    ref = run(lambda x, w: F.rms_norm(x, (HIDDEN,), w, 1e-5), torch.float32)
    return ref, {"torch rms_norm (fused on CUDA)": lambda: run(
                     lambda x, w: F.rms_norm(x, (HIDDEN,), w, 1e-5)),
                 "Liger RMSNorm": lambda: run(liger)}


def measure(rounds: int) -> dict:
    import torch

    out: dict = {"device": torch.cuda.get_device_name(), "shape": dict(
        seq=SEQ, batch=BATCH, hidden=HIDDEN, ffn=FFN, vocab=VOCAB, dtype="bf16"), "ops": {}}
    for op, cases in (("swiglu", swiglu_cases), ("loss", loss_cases), ("rms_norm", norm_cases)):
        ref, variants = cases()
        timed, figures = {}, {}
        for name, fn in variants.items():
            try:
                fn()  # warm-up (torch.compile / Triton builds)
                timed[name], figures[name] = _run(name, fn, ref)
            except Exception as e:  # noqa: BLE001 - a kernel that fails is a figure too
                figures[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        times: dict[str, list[float]] = {n: [] for n in timed}
        for _ in range(rounds):
            for name, fn in timed.items():
                times[name].append(_time(fn, torch.cuda.synchronize))
        base = statistics.median(times[next(iter(times))]) if times else None
        for name, t in times.items():
            figures[name].update(ms=1e3 * statistics.median(t),
                                 spread_ms=1e3 * (max(t) - min(t)),
                                 over_local=statistics.median(t) / base)
        out["ops"][op] = figures
        del ref, variants, timed
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (median, spread)")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("skipped: CUDA is not available on this machine")
        if args.json:
            args.json.write_text(json.dumps({"skipped": "no CUDA"}))
        return 0
    sys.path.insert(0, str(ROOT))
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29541"), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    from megatron.core import parallel_state as ps

    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(0)
    ps.initialize_model_parallel()
    result = measure(args.rounds)
    report(result, args.json)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
