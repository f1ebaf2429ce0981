"""Generation speed: mdtk's engine (megatron-core's static batch with its KV cache, one rank)
against ``transformers.generate`` on the same model, batch and lengths, greedy, in one process,
alternating rounds; and the decode time per token at a context of 64 vs 1024 tokens (with a KV
cache it stays flat; recomputing the context would grow with it).

The model is a Llama of ``--hidden`` / ``--layers`` with random weights (fp32 on CPU, bf16 on
a GPU); both sides get the same prompts (``--batch`` of them, ``--prompt-len`` tokens, the last
ones shorter by up to a quarter, left-padded for transformers) and generate ``--new`` tokens
with end-of-sequence off, so both produce the same number of tokens. Prints medians and spreads
(min-max) and the ratio mdtk / transformers of tokens per second.

    python scripts/bench_generate.py [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_measure import report  # beside this file

ROOT = Path(__file__).resolve().parents[1]


def _model(root: Path, hidden: int, layers: int, vocab: int):
    import torch
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                            num_hidden_layers=layers, num_attention_heads=hidden // 32,
                            num_key_value_heads=hidden // 64, vocab_size=vocab,
                            max_position_embeddings=2048, eos_token_id=vocab - 1,
                            bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(root / "model")
    return model


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    lens = [length - (i * length // (4 * max(batch - 1, 1))) for i in range(batch)]
    return [torch.randint(1, vocab - 1, (n,), generator=g).tolist() for n in lens]


def _timed(fn) -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict:
    import torch

    from toolkit import runtime
    from toolkit.adapters import live
    from toolkit.infer.engine import Generator, Sampling

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        hf = _model(Path(tmp), args.hidden, args.layers, args.vocab).to(device, dtype)
        if device == "cpu":
            runtime.enable_cpu_mode()
        runtime.init_distributed()
        chunks, adapter = live.load_hf(Path(tmp) / "model", dtype=dtype)
    chunks = [c.to(device) for c in chunks]
    # an end id outside the vocabulary: every completion runs its full length, as
    # transformers' min_new_tokens makes its own
    gen = Generator(chunks, eos_ids=[args.vocab + 7], vocab_size=adapter.dims.vocab,
                    max_seq_len=1200 + args.new, max_batch=args.batch)
    never = Sampling(max_new_tokens=args.new)
    prompts = _prompts(args.batch, args.prompt_len, args.vocab)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    ids, mask = ids.to(device), mask.to(device)

    def ours():
        out = gen.generate(prompts, never)
        assert all(len(c.completion_ids) == args.new for c in out), "an eos was drawn"

    def theirs():
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=args.new,
                        min_new_tokens=args.new, do_sample=False, pad_token_id=0)

    ours(), theirs()  # warm-up
    times: dict[str, list[float]] = {"mdtk": [], "transformers": []}
    for _ in range(args.rounds):
        times["mdtk"].append(_timed(ours))
        times["transformers"].append(_timed(theirs))
    tokens = args.batch * args.new
    out = {"device": device, "model": dict(hidden=args.hidden, layers=args.layers,
                                           vocab=args.vocab), "batch": args.batch,
           "prompt_len": args.prompt_len, "new": args.new, "rounds": args.rounds}
    for name, t in times.items():
        out[name] = {"tokens_per_s": tokens / statistics.median(t), "s": statistics.median(t),
                     "spread_s": [min(t), max(t)]}
    ratios = [b / a for a, b in zip(times["mdtk"], times["transformers"], strict=True)]
    out["speed_mdtk_over_transformers"] = {"median": statistics.median(ratios),
                                           "spread": [min(ratios), max(ratios)]}
    out["decode_ms_per_token"] = _decode_times(gen, args)
    return out


def _decode_times(gen, args: argparse.Namespace) -> dict[str, float]:
    """Per-token decode time of one prompt at a context of 64 and 1024 tokens: (time for K new
    tokens - time for 1) / (K - 1), medians of ``--rounds``."""
    from toolkit.infer.engine import Sampling

    out = {}
    for context in (64, 1024):
        (prompt,) = _prompts(1, context, args.vocab)
        one, many = [], []
        for _ in range(args.rounds):
            one.append(_timed(lambda p=prompt: gen.generate([p], Sampling(max_new_tokens=1))))
            many.append(_timed(lambda p=prompt: gen.generate([p], Sampling(
                max_new_tokens=args.new))))
        out[str(context)] = 1e3 * (statistics.median(many) - statistics.median(one)) / (
            args.new - 1)
    out["ratio_1024_over_64"] = out["1024"] / out["64"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (median, spread)")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from toolkit.runtime.ports import free_port

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())),
                 ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    result = measure(args)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
