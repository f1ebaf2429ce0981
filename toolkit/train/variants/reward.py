"""A reward model's export: an HF ``AutoModelForSequenceClassification`` folder (one label),
checked against the live model.

The weights are the run's mapping with the score head (``Adapter.head``): the backbone under
the family's HF names and ``score.weight``; config.json names the family's
``...ForSequenceClassification`` class, ``num_labels: 1`` and the tokenizer's pad id, which
transformers needs to find each sequence's last non-padding token (TRL's RewardTrainer sets it
the same way). With ``export.verify`` the folder is loaded back by transformers on rank 0 and
its scores of a fixed batch are compared with the live model's at the same positions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def export_reward(chunks: list[Any], adapter: Any, out_dir: str,
                  pad_token_id: int | None, *, verify: bool = True,
                  ) -> tuple[str | None, float | None]:
    """(folder, max abs score difference vs the live model, or None without ``verify``)."""
    from toolkit.train.variants.export import export

    def check(chunks: list[Any], adapter: Any, folder: str) -> float:
        return verify_scores(chunks, adapter.dims.vocab, folder, pad_token_id)

    return export(chunks, dataclasses.replace(adapter, pad_token_id=pad_token_id),
                  out_dir, verify=verify, check=check)


def live_scores(chunks: list[Any], tokens: torch.Tensor, pad_token_id: int | None,
                ) -> torch.Tensor:
    """The live model's reward of each row of ``tokens``: its score at the row's last
    non-padding token (on every rank)."""
    from toolkit.adapters.live import forward_logits
    from toolkit.train.data.reward import last_token

    scores = forward_logits(chunks, tokens, 1)[..., 0]  # the head's one column
    for chunk in chunks:
        chunk.train()
    at = [last_token(row.tolist(), pad_token_id) for row in tokens]
    return scores[torch.arange(len(at)), torch.tensor(at)]


def verify_scores(chunks: list[Any], vocab: int, out_dir: str, pad_token_id: int | None,
                  ) -> float:
    """Max abs reward difference on a fixed batch: transformers' sequence classifier loaded
    from ``out_dir`` (rank 0) vs the live model; on every rank."""
    from toolkit.convert.verify import fixed_tokens

    tokens = fixed_tokens(vocab, batch=2, seq_len=16)
    if pad_token_id is not None:  # a padded tail: the reward is read before it
        tokens[1, -3:] = pad_token_id
    mine = live_scores(chunks, tokens, pad_token_id)
    diff = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        diff[0] = (hf_scores(Path(out_dir), tokens) - mine).abs().max().item()
    dist.broadcast(diff, 0)
    return float(diff[0])


def hf_scores(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' rewards of ``tokens`` from a sequence-classification folder (fp32)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits[:, 0].float()
