"""SFT examples -> fixed rows of seq_len + 1 tokens: truncated, dropped, padded or packed
(pretraining samples are megatron-core GPTDataset's: ``pretrain``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pack_sft(examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int,
             pack: bool) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Rows of seq_len+1 tokens and the (seq_len) label mask; truncate, drop, pad or pack."""
    width = seq_len + 1
    rows: list[tuple[list[int], list[int]]] = []
    stats = {"examples": len(examples), "truncated": 0, "dropped": 0}
    cur_ids: list[int] = []
    cur_mask: list[int] = []
    for ids, mask in examples:
        if len(ids) > width:
            stats["truncated"] += 1
            ids, mask = ids[:width], mask[:width]
        if not any(mask[1:]):  # the first token is never a label
            stats["dropped"] += 1
            continue
        if pack and len(cur_ids) + len(ids) <= width:
            cur_ids, cur_mask = cur_ids + list(ids), cur_mask + list(mask)
            continue
        if cur_ids:
            rows.append((cur_ids, cur_mask))
        cur_ids, cur_mask = list(ids), list(mask)
    if cur_ids:
        rows.append((cur_ids, cur_mask))
    tokens = np.full((len(rows), width), pad_id, dtype=np.int32)
    tmask = np.zeros((len(rows), width), dtype=np.uint8)
    for i, (ids, mask) in enumerate(rows):
        tokens[i, : len(ids)] = ids
        tmask[i, : len(mask)] = mask
    return tokens, tmask[:, 1:].copy(), stats
