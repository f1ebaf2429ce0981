"""Token lists -> fixed rows of seq_len + 1 tokens: documents concatenated and cut (pretrain),
examples truncated, dropped, padded or packed (sft)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pack_pretrain(docs: Sequence[Sequence[int]], seq_len: int) -> np.ndarray:
    """Concatenate token lists and cut blocks of seq_len+1 overlapping by one token."""
    stream = np.fromiter((t for d in docs for t in d), dtype=np.int64)
    n = (len(stream) - 1) // seq_len if len(stream) > seq_len else 0
    if n == 0:
        return np.zeros((0, seq_len + 1), dtype=np.int32)
    starts = np.arange(n) * seq_len
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)


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
