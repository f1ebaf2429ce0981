"""SFT examples -> fixed rows of seq_len + 1 tokens: truncated, dropped, padded or bin-packed
with their boundaries recorded (pretraining samples are megatron-core GPTDataset's:
``pretrain``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from toolkit.train.data.segments import first_fit_decreasing, layout


def pack_sft(examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int,
             pack: bool, *, seed: int = 0, formats: Sequence[str] | None = None,
             ) -> tuple[np.ndarray, np.ndarray, dict[str, Any], dict[str, np.ndarray]]:
    """Rows of seq_len+1 tokens, their (seq_len) label mask, stats and where the examples sit.

    Examples longer than seq_len+1 are truncated; those left without a label to learn (the
    first token of an example is never a label) are dropped. Without ``pack`` each example is a
    row, right-padded; with ``pack`` the examples are bin-packed into rows
    (``segments.first_fit_decreasing`` under ``seed``) and the mask of each example's first
    token is 0 (its label position belongs to the previous example). ``formats``: each
    example's row format, for the per-format counts in the stats (rows, truncated, dropped).
    The last value holds ``examples`` / ``row_offsets`` (``segments.layout``)."""
    width = seq_len + 1
    kept: list[tuple[list[int], list[int]]] = []
    per_format: dict[str, dict[str, int]] = {}
    for i, (ids, mask) in enumerate(examples):
        counts = per_format.setdefault(formats[i] if formats else "all",
                                       {"rows": 0, "truncated": 0, "dropped": 0})
        counts["rows"] += 1
        if len(ids) > width:
            counts["truncated"] += 1
            ids, mask = ids[:width], mask[:width]
        if not any(mask[1:]):
            counts["dropped"] += 1
            continue
        kept.append((list(ids), [0, *mask[1:]]))
    bins = (first_fit_decreasing([len(ids) for ids, _ in kept], width, seed) if pack
            else [[i] for i in range(len(kept))])
    tokens = np.full((len(bins), width), pad_id, dtype=np.int32)
    tmask = np.zeros((len(bins), width), dtype=np.uint8)
    for row, members in enumerate(bins):
        at = 0
        for i in members:
            ids, mask = kept[i]
            tokens[row, at:at + len(ids)] = ids
            tmask[row, at:at + len(ids)] = mask
            at += len(ids)
    stats: dict[str, Any] = {
        "examples": len(examples), "truncated": sum(c["truncated"] for c in per_format.values()),
        "dropped": sum(c["dropped"] for c in per_format.values())}
    if formats:
        stats["formats"] = per_format
    where = layout([[len(kept[i][0]) for i in members] for members in bins])
    return tokens, tmask[:, 1:].copy(), stats, where
