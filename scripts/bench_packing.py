"""Packed vs unpacked SFT: loss tokens per second and padding, same model, same layout.

A length-skewed SFT set (example lengths log-normal, median ``seq_len / 8`` by default, the
second half of every example is "response" and carries loss) is laid out twice by the trainer's
own code (``packing.pack_sft``): one example per row, right-padded (``pack=false``), and
bin-packed with the examples kept apart (``pack=true``). One rank trains mdtk's megatron-core
model on every row of each layout (micro-batches through the model with the position ids
``TokenizedSplit.batch`` gives, the token-weighted loss of ``train.loss``, backward, AdamW), so
both process exactly the same loss tokens. Rounds alternate between the two (which goes first
alternates too); the figure is the ratio of loss tokens per second, packed over unpacked, per
round: median and spread (min..max). The padding fraction of each layout is printed too.

    python scripts/bench_packing.py [--rounds 3] [--seq-len 512] [--examples 160] [--json OUT]

On CUDA (the GPU check, ``scripts/gpu_check.py`` part ``packing``) the model is bigger and bf16,
so packed rows go through the varlen kernel when torch or flash-attn has one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU = dict(model=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=2048),
           seq_len=512, examples=160, micro_batch=4, dtype="fp32")
GPU = dict(model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, vocab_size=32000),
           seq_len=4096, examples=96, micro_batch=4, dtype="bf16")


def skewed_examples(n: int, seq_len: int, vocab: int, median: float, sigma: float, seed: int):
    """(ids, mask) pairs: log-normal lengths (2..seq_len+1), mask 1 on the second half."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), 2, seq_len + 1)
    out = []
    for n_tok in lengths.astype(int).tolist():
        ids = rng.integers(2, vocab, n_tok).tolist()
        out.append((ids, [0] * (n_tok // 2) + [1] * (n_tok - n_tok // 2)))
    return out, lengths


def splits(examples, seq_len: int, seed: int):
    """The unpacked and the packed TokenizedSplit of ``examples`` (the trainer's code)."""
    from toolkit.train.data.packing import pack_sft
    from toolkit.train.data.segments import pack_summary
    from toolkit.train.data.split import TokenizedSplit

    out = {}
    for name, pack in (("unpacked", False), ("packed", True)):
        tokens, mask, _, where = pack_sft(examples, seq_len, 1, pack, seed=seed)
        out[name] = (TokenizedSplit(tokens, mask, where, packed=pack),
                     pack_summary(where["examples"], where["row_offsets"], seq_len + 1))
    return out


def epoch_seconds(chunk, opt, split, micro_batch: int, device) -> float:
    """Seconds to train on every row of ``split`` once (fwd + bwd + AdamW per micro-batch)."""
    import numpy as np
    import torch

    from toolkit.models.packed import localise, segments_of
    from toolkit.train.loop.loss import count_step, token_mean

    batches = [split.batch(np.arange(i, min(i + micro_batch, len(split))))
               for i in range(0, len(split), micro_batch)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches:
        counts = count_step([b])
        segments = segments_of(b["position_ids"])
        b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
        per_token = chunk(b["tokens"], b["position_ids"], None, labels=b["labels"],
                          packed_seq_params=localise(segments, b["position_ids"]))
        token_mean(per_token, b, counts).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def kernel_agreement(dtype, device) -> dict | None:
    """On CUDA with a varlen kernel: its bf16 output on packed rows against SDPA per example in
    fp32 (the CPU path, tested in fp64 against a block mask), max abs difference; None without
    one."""
    import torch

    from toolkit.models import packed

    name = packed.kernel_name(dtype, device)
    if name == packed.KERNELS[2]:
        return None
    s = 4096
    seg = packed.Segments(qkv_format="sbhd", starts=((0, 100, 900, 3000), (0, 2000)), seq_len=s,
                          max_seqlen_q=s, max_seqlen_kv=s)
    g = torch.Generator(device=device).manual_seed(3)
    q, k, v = (torch.randn(s, 2, h, 64, generator=g, device=device, dtype=dtype)
               for h in (16, 8, 8))
    got = packed._varlen(name, q, k, v, seg, 0.125, 0.0, None)
    ref = packed._per_example(q.float(), k.float(), v.float(), seg, 0.125, 0.0, None)
    return {"kernel": name, "max_abs_diff_vs_sdpa_per_example_fp32": float(
        (got.float() - ref).abs().max()), "max_abs_reference": float(ref.abs().max())}


def run(opts: dict, rounds: int, median: float | None, sigma: float, seed: int) -> dict:
    import torch
    from bench_attention import _init_single_rank  # scripts/ is on the path
    from transformers import LlamaConfig

    from toolkit import parallel, runtime
    from toolkit.adapters import adapter_for, live
    from toolkit.models import packed as packed_mod
    from toolkit.parallel import ParallelLayout

    _init_single_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[opts["dtype"]]
    layout = ParallelLayout().resolve(1)
    parallel.initialize(layout, seed=seed)
    try:
        hf = LlamaConfig(**opts["model"], max_position_embeddings=opts["seq_len"] + 1,
                         eos_token_id=0, pad_token_id=1,
                         architectures=["LlamaForCausalLM"])
        adapter = adapter_for(hf, dtype=dtype)
        chunk = live.build_model(adapter, layout)[0]
        device = runtime.device()
        chunk.to(device)
        opt = torch.optim.AdamW(chunk.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
        seq = opts["seq_len"]
        examples, lengths = skewed_examples(opts["examples"], seq, opts["model"]["vocab_size"],
                                            median or seq / 8, sigma, seed)
        data = splits(examples, seq, seed)
        loss_tokens = int(data["packed"][0].loss_mask.sum())
        assert loss_tokens == int(data["unpacked"][0].loss_mask.sum())
        for split, _ in data.values():  # warm-up: kernels, allocator, optimizer state
            epoch_seconds(chunk, opt, split, opts["micro_batch"], device)
        times: dict[str, list[float]] = {"packed": [], "unpacked": []}
        for r in range(rounds):
            order = ("packed", "unpacked") if r % 2 == 0 else ("unpacked", "packed")
            for name in order:
                times[name].append(epoch_seconds(chunk, opt, data[name][0],
                                                 opts["micro_batch"], device))
        ratios = [u / p for p, u in zip(times["packed"], times["unpacked"], strict=True)]
        kernel = packed_mod.kernel_name(dtype, device)
        return {
            "kernel_agreement": kernel_agreement(dtype, device),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "kernel": kernel, "dtype": opts["dtype"], "seq_len": seq,
            "micro_batch": opts["micro_batch"], "model": opts["model"],
            "examples": len(examples), "median_length": float(sorted(lengths)[len(lengths) // 2]),
            "loss_tokens": loss_tokens,
            **{f"{n}_rows": len(data[n][0]) for n in data},
            **{f"{n}_padding_fraction": round(data[n][1]["padding_fraction"], 4) for n in data},
            **{f"{n}_loss_tokens_per_s": round(loss_tokens / statistics.median(times[n]), 1)
               for n in data},
            "seconds": times, "speedup_median": round(statistics.median(ratios), 3),
            "speedup_min": round(min(ratios), 3), "speedup_max": round(max(ratios), 3),
        }
    finally:
        parallel.destroy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=None, help="default: 512 CPU, 4096 GPU")
    ap.add_argument("--examples", type=int, default=None, help="default: 160 CPU, 96 GPU")
    ap.add_argument("--median", type=float, default=None, help="median example length "
                    "(default seq_len / 8)")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the lengths")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    opts = dict(GPU if torch.cuda.is_available() else CPU)
    if args.seq_len:
        opts["seq_len"] = args.seq_len
    if args.examples:
        opts["examples"] = args.examples
    res = run(opts, args.rounds, args.median, args.sigma, args.seed)
    print(json.dumps({k: v for k, v in res.items() if k not in ("model", "seconds")}, indent=1))
    print(f"packed / unpacked loss tokens/s: {res['speedup_median']:.2f}x "
          f"(min {res['speedup_min']:.2f}, max {res['speedup_max']:.2f}) over {args.rounds} "
          f"rounds; padding {100 * res['unpacked_padding_fraction']:.1f}% -> "
          f"{100 * res['packed_padding_fraction']:.1f}%; kernel: {res['kernel']}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
