"""Where examples sit in the rows of a split, and the position ids that keep them apart.

- ``first_fit_decreasing``: SFT examples into rows of ``seq_len + 1`` tokens, longest first, each
  into the first row with room (a segment tree over the rows' free space: n log n), ties broken
  by a permutation drawn from the seed, so the packs depend only on (lengths, seed).
- A split records its examples as ``examples`` [E, 2] int32 (start, length) in row order and
  ``row_offsets`` [N + 1] (row i holds examples ``row_offsets[i]:row_offsets[i+1]``).
- ``packed_positions``: position ids of a micro-batch that restart at every example and at the
  padding after the last one (padding attends only to padding); ``eod_positions``: position ids
  that restart after every EOD token (pretraining with ``data.reset_at_eod``, as Megatron-LM's
  ``--reset-position-ids --reset-attention-mask``). The model reads example boundaries off the
  position ids (``toolkit.models.packed``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def first_fit_decreasing(lengths: Sequence[int], capacity: int, seed: int) -> list[list[int]]:
    """Bins (lists of item indices, each summing to <= ``capacity``) for items of ``lengths``
    (each <= capacity): items by decreasing length (ties in a seeded random order), each into
    the first bin it fits."""
    n = len(lengths)
    if n == 0:
        return []
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.max() > capacity:
        raise ValueError(f"an item of {lengths.max()} exceeds the capacity {capacity}")
    tie = np.random.default_rng([seed, 0xFFD]).permutation(n)
    order = np.lexsort((tie, -lengths))
    size = 1 << max(n - 1, 1).bit_length()
    free = np.zeros(2 * size, dtype=np.int64)  # max free space under each node
    free[size:size + n] = capacity  # bins not yet opened have all their room
    for node in range(size - 1, 0, -1):
        free[node] = max(free[2 * node], free[2 * node + 1])
    tree = free.tolist()  # Python ints: the loop below is the hot path
    bins: list[list[int]] = []
    for item in order.tolist():
        need = int(lengths[item])
        node = 1
        while node < size:  # the leftmost bin with room
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def layout(rows: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """``examples`` and ``row_offsets`` of rows given as their examples' lengths, in order."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    examples = np.zeros((int(offsets[-1]), 2), dtype=np.int32)
    k = 0
    for r in rows:
        start = 0
        for n in r:
            examples[k] = (start, n)
            start += n
            k += 1
    return {"examples": examples, "row_offsets": offsets}


def packed_positions(examples: np.ndarray, row_offsets: np.ndarray, rows: np.ndarray,
                     seq_len: int) -> np.ndarray:
    """Position ids [len(rows), seq_len] of the model inputs of ``rows`` (token positions
    0..seq_len-1 of each row): 0, 1, ... from every example's first token, and from the first
    padding token after the last example. A row index -1 (a filler row) is one segment."""
    starts = np.zeros((len(rows), seq_len), dtype=bool)
    starts[:, 0] = True
    for j, r in enumerate(np.asarray(rows).tolist()):
        if r < 0:
            continue
        ex = examples[row_offsets[r]:row_offsets[r + 1]]
        if not len(ex):
            continue
        cut = np.append(ex[:, 0], ex[-1, 0] + ex[-1, 1])  # example starts, then the padding
        starts[j, cut[cut < seq_len]] = True
    return _restart(starts)


def eod_positions(tokens: np.ndarray, eod: int) -> np.ndarray:
    """Position ids [b, s] of inputs ``tokens`` [b, s] restarting after every ``eod`` token
    (the EOD token ends its document; the next token starts at 0)."""
    starts = np.zeros(tokens.shape, dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod
    return _restart(starts)


def _restart(starts: np.ndarray) -> np.ndarray:
    """Positions counting from the last True of each row (``starts[:, 0]`` is True)."""
    idx = np.arange(starts.shape[1], dtype=np.int64)
    last = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return idx - last


def pack_summary(examples: np.ndarray, row_offsets: np.ndarray, width: int) -> dict[str, float]:
    """Examples per row (mean, min, max) and the padding fraction of rows of ``width``
    tokens."""
    per_row = np.diff(row_offsets)
    used = int(examples[:, 1].sum()) if len(examples) else 0
    rows = len(per_row)
    return {"examples_per_row": float(per_row.mean()) if rows else 0.0,
            "examples_per_row_min": int(per_row.min()) if rows else 0,
            "examples_per_row_max": int(per_row.max()) if rows else 0,
            "tokens": used,
            "padding_fraction": 1.0 - used / (rows * width) if rows else 0.0}
