"""ZeRO++'s quantizer kernels (qwZ int8 parameter gathers, qgZ int4 gradient reduction) on one
device: their time against a plain copy of the same tensor, and their error.

What the planner assumes (``toolkit.planner.zeropp.kernel_bytes``): the kernels are bound by
memory bandwidth. The baseline is ``clone()`` of the bf16 tensor (read 2 + write 2 bytes per
element), measured in the same process; rounds alternate between the three. Each kernel is run
the way DeepSpeed 0.19 runs it: qwZ through ``CUDAQuantizer`` (fp16 cast, int8 symmetric, one
scale per <= 8000 elements, dequantized to fp16 and cast back), qgZ through the quantizer op's
``swizzle_quant`` + ``quantized_reduction`` + ``dequantize`` (int4, one scale per row), the
sequence of DeepSpeed's ``all_to_all_quant_reduce`` on one node, with fp16 input (what mdtk
configures: ``communication_data_type: fp16``) and with bf16 input (DeepSpeed's default for a bf16
run, which its kernel reads as fp16: the error shows it). The bytes each kernel is
modelled to move come from the planner's ``kernel_bytes``; each error is checked against what a
symmetric round trip of that width gives on Gaussian data (``ERROR_BOUND``). Where DeepSpeed has no
quantizer op (CPU) the JSON says why (``toolkit.runtime.ops.quantizer_missing``) and nothing is
timed: mdtk refuses qwZ/qgZ there with that reason.

    python scripts/bench_zeropp.py [--rows 8192] [--cols 8192] [--rounds 7] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench_measure import report  # beside this file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _kernels(x):
    """name -> (callable returning the round trip, modelled bytes per element)."""
    import torch
    from deepspeed.ops.op_builder import QuantizerBuilder
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

    qwz = CUDAQuantizer()
    op = QuantizerBuilder().load()
    rows = x.shape[0]

    def copy():
        return x.clone()

    def int8_roundtrip():  # what a qwZ gather does to the parameters, without the wire
        q, scale = qwz.quantize(x)
        return qwz.dequantize(q, scale, dtype=torch.bfloat16).view_as(x)

    def int4_roundtrip(grads):  # qgZ on one node, DeepSpeed's own sequence with all-to-alls of
        # one (all_to_all_quant_reduce): quantize swizzled, reduce what arrived, dequantize
        def run():
            q, scale = op.swizzle_quant(grads, rows, 4, op.Symmetric, 1, 1, 1)
            q, scale = op.quantized_reduction(q, scale, rows, rows, 4, op.Symmetric, 1)
            out = op.dequantize(q, scale, scale.numel(), 4, op.Symmetric)
            return out.view(-1)[:x.numel()].view_as(x).to(torch.bfloat16)
        return run

    # qgZ gets the gradients in the communication dtype: the training dtype (bf16) unless
    # communication_data_type says fp16, which mdtk requires (its kernel reads fp16 only)
    return {"copy": (copy, 4.0), "qwZ int8": (int8_roundtrip, _modelled("qwz")),
            "qgZ int4": (int4_roundtrip(x.half()), _modelled("qgz")),
            "qgZ int4, bf16 input": (int4_roundtrip(x), _modelled("qgz"))}


def _modelled(kind: str) -> float:
    """HBM bytes per element of one qwZ gather / one qgZ reduction on one node, bf16: the
    planner's own figure (``kernel_bytes``), so this measures the model, not a copy of it."""
    from toolkit.planner.zeropp import ZeroPP, kernel_bytes

    zpp = ZeroPP(qwz=kind == "qwz", qgz=kind == "qgz")
    per = kernel_bytes(1.0, 1, "bf16", 2, zpp, 1, 1)
    return per / 2 if kind == "qwz" else per  # qwZ: two gathers per micro-batch in the model


#: Expected relative error of a symmetric round trip on Gaussian data, one scale per row of
#: 8192: step = max / (2^(b-1) - 1) with max ~ 3.9 sigma, error ~ step / sqrt(12): int8 0.009,
#: int4 0.16. A figure far above that is a broken round trip, not a property of the kernel.
ERROR_BOUND = {"copy": 0.0, "qwZ int8": 0.02, "qgZ int4": 0.25, "qgZ int4, bf16 input": 0.25}


def run(rows: int, cols: int, rounds: int) -> dict:
    import torch

    from toolkit.runtime.ops import prepare_cuda_arch_list, quantizer_missing

    arch_list = prepare_cuda_arch_list()  # as mdtk's engines do, before the op's JIT build
    missing = quantizer_missing()
    if missing:
        return {"available": False, "reason": missing}
    device = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    start = time.perf_counter()
    kernels = _kernels(x)
    out = {"available": True, "device": torch.cuda.get_device_name(), "rows": rows,
           "cols": cols, "arch_list": arch_list,
           "load_s": round(time.perf_counter() - start, 2), "kernels": {}}
    for name, (fn, _) in list(kernels.items()):  # warm-up; a kernel that fails is recorded
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the error is the figure
            out["kernels"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            del kernels[name]
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, (fn, _) in kernels.items():
            times[name].append(_timed(fn, torch.cuda.synchronize))
    base = statistics.median(times["copy"])
    ref = x.float()
    for name, (fn, bytes_per) in kernels.items():
        t = times[name]
        err = (fn().float() - ref).norm() / ref.norm()
        out["kernels"][name] = {
            "median_ms": round(1e3 * statistics.median(t), 3),
            "spread_ms": round(1e3 * (max(t) - min(t)), 3),
            "ratio_vs_copy": round(statistics.median(t) / base, 3),
            "modelled_bytes_per_element": bytes_per,
            "achieved_gbs_at_modelled_bytes": round(
                bytes_per * x.numel() / statistics.median(t) / 1e9, 1),
            "relative_error": float(err), "error_within_bound": float(err) <= ERROR_BOUND[name]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192, help="tensor rows (qgZ: one scale each)")
    parser.add_argument("--cols", type=int, default=8192, help="tensor columns")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (median, spread)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    result = run(args.rows, args.cols, args.rounds)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
