"""Core attention kernels on one device: mdtk's CP attention (cp=1), megatron-core's local
``DotProductAttention`` and mdtk's ``SDPAttention``, forward + backward, causal GQA.

The baseline is megatron-core's local path (what megatron-core runs without Transformer
Engine); every figure is a ratio against it measured in the same process, rounds alternating
between the kernels. A kernel that runs out of memory at a length is recorded as OOM, not as a
failure of the benchmark. The outputs of the two mdtk kernels are compared with SDPA's at the
first length (bf16: a sanity bound, the fp32 equality lives in tests/test_gpu_cp.py).

    python scripts/bench_attention.py [--seqs 8192,32768] [--repeats 5] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("SDPAttention", "CPAttention", "DotProductAttention")  # the local path last: its
#                                          global buffer keeps s x s scores after it has run
BASELINE = "DotProductAttention"
#: SDPA's CUDA kernels one at a time: which one torch picks decides time and memory.
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


class _Pinned:
    """``SDPAttention`` with torch's SDPA restricted to one backend."""

    def __init__(self, module, backend: str) -> None:
        self.module, self.backend = module, backend

    def __call__(self, *args):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, self.backend)]):
            return self.module(*args)


def _init_single_rank() -> None:
    from toolkit.runtime.ports import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def _modules(heads: int, groups: int, dim: int, dtype):
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from toolkit.models import transformer_config
    from toolkit.models.attention import SDPAttention
    from toolkit.models.cp_attention import CPAttention

    config = transformer_config(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                                num_query_groups=groups, attention_dropout=0.0,
                                params_dtype=dtype, bf16=dtype == torch.bfloat16)
    classes = {"DotProductAttention": DotProductAttention, "SDPAttention": SDPAttention,
               "CPAttention": CPAttention}
    modules = {name: classes[name](config, 1, AttnMaskType.causal, "self") for name in KERNELS}
    if torch.cuda.is_available():
        for backend in SDPA_BACKENDS:
            modules[f"SDPA[{backend}]"] = _Pinned(modules["SDPAttention"], backend)
    modules[BASELINE] = modules.pop(BASELINE)  # still last
    return modules


def _time_once(module, q, k, v, dout) -> float:
    """Seconds of one forward + backward, synchronised on CUDA."""
    import torch

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if q.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    module(*leaves, None).backward(dout)
    if q.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(seq: int, *, heads: int, groups: int, dim: int, repeats: int, dtype_name: str,
            check: bool) -> dict:
    """Median fwd+bwd ms and peak memory of each kernel at ``seq`` tokens (batch 1)."""
    import torch

    from toolkit import runtime

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    dev = runtime.device()
    modules = _modules(heads, groups, dim, dtype)
    g = torch.Generator().manual_seed(11)

    def rand(*shape: int):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    q, k, v = rand(seq, 1, heads, dim), rand(seq, 1, groups, dim), rand(seq, 1, groups, dim)
    dout = rand(seq, 1, heads * dim)
    out: dict = {"seq": seq, "ms": {}, "peak_gib": {}, "oom": []}
    samples: dict[str, list[float]] = {name: [] for name in modules}
    alive = list(modules)
    for round_ in range(repeats + 1):  # round 0 warms kernels and allocators up
        for name in list(alive):
            if dev.type == "cuda":  # the kernel's own peak: above what is held before it runs
                torch.cuda.empty_cache()  # (megatron-core's global buffer keeps the local
                torch.cuda.reset_peak_memory_stats()  # path's s x s scores between calls)
                held = torch.cuda.memory_allocated()
            try:
                seconds = _time_once(modules[name], q, k, v, dout)
            except torch.OutOfMemoryError:
                alive.remove(name)
                out["oom"].append(name)
                continue
            except RuntimeError as e:  # a pinned SDPA backend that cannot take these inputs
                alive.remove(name)
                out.setdefault("unavailable", {})[name] = str(e).splitlines()[0][:200]
                continue
            if round_:
                samples[name].append(seconds)
            if dev.type == "cuda":
                out["peak_gib"][name] = max(out["peak_gib"].get(name, 0.0),
                                            (torch.cuda.max_memory_allocated() - held) / 2**30)
    for name in alive:
        out["ms"][name] = 1e3 * statistics.median(samples[name])
        out.setdefault("spread_ms", {})[name] = 1e3 * (max(samples[name]) - min(samples[name]))
    if BASELINE in out["ms"]:
        out["speedup_vs_local"] = {name: out["ms"][BASELINE] / ms
                                   for name, ms in out["ms"].items()}
    if check and "SDPAttention" in alive and "CPAttention" in alive:
        with torch.no_grad():
            ref = modules["SDPAttention"](q, k, v, None).float()
            cp = modules["CPAttention"](q, k, v, None).float()
        out["cp_vs_sdpa_max_abs"] = (cp - ref).abs().max().item()
        out["output_scale"] = ref.abs().max().item()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8192,32768", help="comma-separated sequence lengths")
    ap.add_argument("--heads", type=int, default=32, help="query heads (Llama-8B: 32)")
    ap.add_argument("--groups", type=int, default=8, help="KV heads (Llama-8B: 8)")
    ap.add_argument("--dim", type=int, default=128, help="head dimension")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per kernel")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()

    import torch

    from toolkit import parallel, runtime
    from toolkit.parallel import ParallelLayout

    if not runtime.use_cuda():
        runtime.enable_cpu_mode()
    _init_single_rank()
    runtime.init_distributed()
    parallel.initialize(ParallelLayout())
    try:
        results = [measure(int(s), heads=args.heads, groups=args.groups, dim=args.dim,
                           repeats=args.repeats, dtype_name=args.dtype, check=i == 0)
                   for i, s in enumerate(args.seqs.split(","))]
    finally:
        parallel.destroy()
    report = {"device": torch.cuda.get_device_name() if runtime.use_cuda() else "cpu",
              "dtype": args.dtype, "heads": args.heads, "groups": args.groups, "dim": args.dim,
              "results": results}
    for r in results:
        cells = [f"{name} {ms:.2f} ms" for name, ms in r["ms"].items()] + r["oom"]
        print(f"seq {r['seq']}: " + ", ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
