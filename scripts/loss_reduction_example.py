"""The token-weighted validation loss against the mean of row means (mdtk's reduction before
issue 26, at micro_batch 1) on the same rows: how far apart they are once a model's loss depends
on the row (docs/training.md, "Packed sequences and the token-weighted loss").

The model (an HF folder) is first fine-tuned for ``--steps`` AdamW steps on the bundled SFT
data's training rows (so its loss differs between short and long answers), then both reductions
are computed with transformers over the validation rows mdtk prepares (``prepare_data``: seq_len
64, validation_split 0.1, seed 1234).

    python scripts/loss_reduction_example.py MODEL_DIR TOKENIZER_DIR [--steps 60]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def per_token(model, batch):
    import torch

    logits = model(batch["tokens"]).logits
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"],
                                             reduction="none")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("tokenizer")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit import bundled
    from toolkit.train.data import DataSettings, prepare_data

    torch.manual_seed(0)
    settings = DataSettings(mode="sft", seq_len=64, validation_split=0.1, seed=1234,
                            sources=(str(bundled.path(bundled.DATA) / "sft.jsonl"),))
    with tempfile.TemporaryDirectory() as cache:
        data = prepare_data(settings, args.tokenizer, cache)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    for _ in range(args.steps):
        b = data.train.batch(rng.choice(len(data.train), 16, replace=False))
        mask = b["loss_mask"]
        ((per_token(model, b) * mask).sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    val = data.validation.batch(np.arange(len(data.validation)))
    with torch.no_grad():
        losses = per_token(model, val).double()
    mask = val["loss_mask"].double()
    rows = (losses * mask).sum(1) / mask.sum(1)
    tokens = mask.sum(1)
    print(f"validation rows {len(rows)}, loss tokens per row {int(tokens.min())}.."
          f"{int(tokens.max())} (median {int(tokens.median())})")
    print(f"token-weighted {float((losses * mask).sum() / mask.sum()):.4f}; mean of row means "
          f"(old, micro_batch 1) {float(rows.mean()):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
