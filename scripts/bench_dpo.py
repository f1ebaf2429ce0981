"""DPO on one GPU: step time and peak memory of ``data.mode: dpo`` (with a reference model, and
with ``precompute_reference``) against SFT on the same tokens, and the memory model's figures.

A Llama (hidden 1024, 8 layers, vocab 32000, random weights; reference = the same checkpoint)
trained in bf16 through ``toolkit.train.trainer.run`` on one device, the bundled example data:
SFT with micro-batches of 2m rows vs DPO with m pairs (2m rows: the same tokens a step), so the
DPO/SFT step-time ratio shows the reference forward's cost (expected ~1.3-1.5 with the model,
~1.0 precomputed). Rounds alternate the three runs; medians after warm-up steps.

    python scripts/bench_dpo.py [--steps 12] [--rounds 2] [--seq 512] [--micro 4] --json OUT
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
sys.path.insert(0, str(ROOT))
WARMUP = 3
MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)
DATA = {"sft": ["bundled:examples/data/sft.jsonl"],
        "dpo": ["bundled:examples/data/dpo.jsonl", "bundled:examples/data/dpo_text.jsonl"]}


def make_model(root: Path) -> dict[str, str]:
    import torch
    import transformers as tf

    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(root / "tokenizer")
    config = tf.LlamaConfig(**MODEL, rms_norm_eps=1e-5, max_position_embeddings=4096,
                            eos_token_id=0, pad_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    return {"model": str(root / "model"), "tokenizer": str(tok), "cache": str(root / "cache")}


def run(kind: str, assets: dict[str, str], out: Path, args) -> dict:
    """One trainer run; step time median (after warm-up) and the device's peak memory."""
    import torch

    from toolkit.train import trainer
    from toolkit.train.config import config_from_dict

    dpo = kind != "sft"
    micro = args.micro if dpo else 2 * args.micro  # the same rows (tokens) per micro-batch
    raw = {"output_dir": str(out), "model": {"path": assets["model"],
                                             "tokenizer": assets["tokenizer"]},
           "deepspeed": {"zero_stage": 1, "offload": "none"},
           "data": {"mode": "dpo" if dpo else "sft", "sources": DATA["dpo" if dpo else "sft"],
                    "validation_split": 0.0, "cache_dir": assets["cache"]},
           "optim": {"lr": 1e-5, "decay": "constant", "clip_grad": 1.0},
           "train": {"steps": args.steps, "micro_batch": micro, "global_batch": micro * 2,
                     "seq_len": args.seq, "precision": "bf16"},
           "checkpoint": {"interval": 0, "resume": "none"}, "logging": {"interval": 1}}
    if dpo:
        raw["dpo"] = {"precompute_reference": kind == "dpo_precomputed"}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer.run(config_from_dict(raw))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[WARMUP:]),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def predicted(args) -> dict[str, float]:
    """The memory model's model states and GPU peak per kind (GiB)."""
    from toolkit.memory import TrainShape, ZeroOptions, estimate, model_shape_from_hf
    from toolkit.parallel.layout import ParallelLayout

    shape = model_shape_from_hf({**MODEL, "model_type": "llama"})
    out = {}
    for kind, train in (("sft", dict(micro_batch=2 * args.micro)),
                        ("dpo", dict(micro_batch=args.micro, pairs=True, reference_model=True)),
                        ("dpo_precomputed", dict(micro_batch=args.micro, pairs=True))):
        est = estimate(shape, TrainShape(seq_len=args.seq, dtype="bf16", **train),
                       ParallelLayout().resolve(1), ZeroOptions(stage=1))
        out[kind] = {"model_states_gib": est.model_states() / 2**30,
                     "gpu_peak_gib": est.gpu / 2**30}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2, help="alternating sft/dpo/precomputed rounds")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro", type=int, default=4, help="pairs per DPO micro-batch")
    p.add_argument("--json", type=Path, help="write the figures here (scripts/gpu_check.py)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("skipped: CUDA is not available on this machine")
        if args.json:
            args.json.write_text(json.dumps({"skipped": "no CUDA"}))
        return 0
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    kinds = ("sft", "dpo", "dpo_precomputed")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench_dpo_") as tmp:
        assets = make_model(Path(tmp))
        for r in range(args.rounds):
            for kind in kinds:
                runs[kind].append(run(kind, assets, Path(tmp) / f"{kind}_{r}", args))
    figures = {k: {"step_s": statistics.median(x["step_s"] for x in v),
                   "step_s_spread": [min(x["step_s"] for x in v), max(x["step_s"] for x in v)],
                   "peak_gib": max(x["peak_gib"] for x in v)} for k, v in runs.items()}
    sft = figures["sft"]["step_s"]
    summary = {"device": torch.cuda.get_device_name(), "model": MODEL, "seq": args.seq,
               "pairs_per_micro": args.micro, "runs": figures, "predicted": predicted(args),
               "dpo_over_sft": figures["dpo"]["step_s"] / sft,
               "precomputed_over_sft": figures["dpo_precomputed"]["step_s"] / sft}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
