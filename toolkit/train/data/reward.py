"""``data.mode: reward``: preference pairs for a Bradley-Terry reward model, rendered as TRL's
``RewardTrainer`` renders them, stored as one sample per pair: tokens [N, 2, seq_len+1] (chosen,
rejected), and a mask [N, 2, seq_len] with a single 1 at the position whose score is the
sequence's reward: its last non-padding token (the rightmost token that is not the pad id, as
transformers' ``...ForSequenceClassification`` reads it; with pad = EOS a trailing EOS is
skipped there too).

Rows are the DPO rows (``preference``: ``{prompt?, chosen, rejected}``, strings or turns) with an
optional number ``margin`` (TRL's: the loss is ``-log sigmoid(r_chosen - r_rejected -
margin)``), given on every row or on none. Each sequence is the whole prompt + completion: no
prompt is needed and chosen may equal rejected. A sequence longer than ``seq_len`` tokens
cannot be scored whole: the pair is dropped and counted (TRL drops pairs over
``max_length``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from toolkit.train.data.preference import FIELDS, encode_parts, render, split_prompt
from toolkit.train.data.progress import SplitProgress
from toolkit.train.data.settings import DataError, DataSettings
from toolkit.train.data.sources import RowsPart

MARGIN = "margin"  # TRL's column name


def encode_reward_row(row: dict[str, Any], tokenizer, settings: DataSettings,
                      ) -> tuple[list[int], list[int], float]:
    """(chosen ids, rejected ids, margin or NaN) of one row, as TRL tokenises it."""
    prompt, chosen, rejected = split_prompt(row, settings)
    pc, pr = render(prompt, (chosen, rejected), tokenizer, settings, with_prompt=False)
    margin = row.get(MARGIN)
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not math.isfinite(margin)):
        raise DataError(f"'margin' must be a finite number, got {margin!r}.")
    return pc, pr, float("nan") if margin is None else float(margin)


def last_token(ids: Sequence[int], pad_id: int | None) -> int:
    """Where the reward is read: the rightmost position not holding ``pad_id``."""
    for p in range(len(ids) - 1, -1, -1):
        if ids[p] != pad_id:
            return p
    return -1


def pack_reward_pairs(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int,
                      pad_id: int) -> tuple[np.ndarray, np.ndarray, dict[str, int], np.ndarray]:
    """-> tokens [N, 2, L+1] int32 (padded), mask [N, 2, L] uint8 (the scored position), stats,
    and the kept pairs' indices; a pair with a sequence over L tokens (or all padding) is
    dropped and counted."""
    kept = [i for i, (c, r) in enumerate(pairs)
            if max(len(c), len(r)) <= seq_len and min(last_token(c, pad_id),
                                                       last_token(r, pad_id)) >= 0]
    tokens = np.full((len(kept), 2, seq_len + 1), pad_id, dtype=np.int32)
    mask = np.zeros((len(kept), 2, seq_len), dtype=np.uint8)
    for k, i in enumerate(kept):
        for j, ids in enumerate(pairs[i]):
            tokens[k, j, :len(ids)] = ids
            mask[k, j, last_token(ids, pad_id)] = 1
    return tokens, mask, {"pairs": len(pairs), "dropped": len(pairs) - len(kept)}, \
        np.asarray(kept, dtype=np.int64)


def tokenize(parts: Sequence[RowsPart], tokenizer, settings: DataSettings, procs: int | None,
             progress: SplitProgress):
    """-> (tokens [N, 2, L+1], mask [N, 2, L], stats, {"margin": [N] float32} when the rows
    give margins); sources in order."""
    def enc(row):
        c, r, margin = encode_reward_row(row, tokenizer, settings)
        return {"chosen": c, "rejected": r, "margin": margin}

    out = encode_parts(parts, enc, (settings.prompt_field, *FIELDS), progress, procs)
    margins = np.asarray(out.get("margin", []), dtype=np.float64)
    given = ~np.isnan(margins)
    if given.any() and not given.all():
        row = int(np.flatnonzero(~given)[0]) + 1
        raise DataError(f"'margin' is given on some rows but not on row {row} of the "
                        f"{progress.name} sources: give it on every row or on none.")
    pairs = list(zip(out.get("chosen", []), out.get("rejected", []), strict=True))
    tokens, mask, stats, kept = pack_reward_pairs(pairs, settings.seq_len,
                                                  tokenizer.pad_token_id)
    extra = {MARGIN: margins[kept].astype(np.float32)} if given.any() else {}
    return tokens, mask, stats, extra
