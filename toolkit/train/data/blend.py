"""Pretraining samples of a split over one or more sources (``IndexedSplit``).

Training reads an endless stream: position ``p`` is a source (megatron-core's greedy blending
indices over the normalised ``data.weights``, the ``BlendedDataset``; they are prefix-stable:
the source of position p does not depend on how many positions are built) and that source's
next sample. A source's samples run through its one-epoch GPTDataset in Megatron's own order,
then, epoch after epoch, through seeded permutations of it (``Endless``). So the samples of
optimizer step s, positions [s*G, (s+1)*G), depend only on the seed, the data, G and s (not on
the run's length, dp or micro-batch), and a run inside one epoch of each source reads what
Megatron-LM reads (Megatron-LM's own builder sizes the indices from ``train_iters``, which
changes the order of every sample once a second epoch is asked for).

Validation reads each source's held-out samples once, the sources interleaved in proportion to
their sizes (megatron-core's exhaustive blending).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.atomic import building_once
from toolkit.train.data import segments
from toolkit.train.data.gpt_sources import _quiet

ENDLESS = 1 << 62  # positions of a single-source stream never wrap


@functools.lru_cache(maxsize=8)
def _order(n: int, seed: int, source: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, 0xB1E4D, source, epoch]).permutation(n)


class Endless:
    """The samples of one source's GPTDataset at any position: epoch 0 in GPTDataset's order,
    epoch e >= 1 in a permutation seeded by (seed, source, e)."""

    def __init__(self, gpt, seed: int, source: int):
        if len(gpt) < 1:
            raise ValueError("a source without samples cannot be streamed")
        self.gpt, self.n, self.seed, self.source = gpt, len(gpt), seed, source
        self.index_split = gpt.index_split  # BlendedDataset checks both
        self.unique_identifiers = {"class": "mdtk.Endless", "dataset": gpt.unique_identifiers,
                                   "seed": seed, "source": source}

    def __len__(self) -> int:  # never oversampled (BlendedDataset compares its counts with it)
        return ENDLESS

    def __getitem__(self, position: int) -> dict[str, Any]:
        epoch, i = divmod(int(position), self.n)
        if epoch:
            i = int(_order(self.n, self.seed, self.source, epoch)[i])
        return self.gpt[i]


class IndexedSplit:
    """The samples of a split. ``names``: the sources (data.sources entries). Training splits
    are streams (``reserve`` before reading); validation splits are read by index."""

    def __init__(self, names: Sequence[str], datasets: Sequence, weights: Sequence[float] | None,
                 *, stream: bool, seq_len: int, cache: Path | None = None):
        self.names = list(names)
        self.datasets = list(datasets)
        self.stream, self.seq_len, self.cache = stream, seq_len, cache
        sizes = [d.n if isinstance(d, Endless) else len(d) for d in self.datasets]
        self.sizes = sizes
        self.weights = list(weights) if weights is not None else [float(s) for s in sizes]
        self.blend = None
        self.reset_eod: int | None = None  # data.reset_at_eod: the EOD id
        self.length = ENDLESS if stream and len(self.datasets) == 1 else 0
        if not stream and len(self.datasets) > 1:
            self.blend = _blended(self.datasets, [int(s) for s in sizes], None, None)
            self.length = len(self.blend)
        elif not stream:
            self.length = sizes[0]

    def __len__(self) -> int:
        """Samples in one pass over every source (training: what ``train.epochs`` counts)."""
        return int(sum(self.sizes))

    def reserve(self, num_samples: int) -> None:
        """Make positions [0, num_samples) readable (collective for a multi-source stream:
        rank 0 builds the blending indices into the cache, the others map them)."""
        if not self.stream or len(self.datasets) == 1 or num_samples <= self.length:
            return
        size = 1 << max(16, (num_samples - 1).bit_length())  # prefix-stable: round up
        self.blend = _blend_collective(self.datasets, self.weights, size, self.cache)
        self.length = size

    def sampler_args(self, shuffle: bool) -> tuple[int, bool]:
        """(num_samples, shuffle) for ``GlobalBatchSampler``: a stream is read in order."""
        return (self.length, False) if self.stream else (len(self), shuffle)

    def sources_of(self, positions: np.ndarray) -> np.ndarray:
        """The source index of each position."""
        if self.blend is None:
            return np.zeros(len(positions), dtype=np.int64)
        return np.asarray(self.blend.dataset_index[np.asarray(positions)], dtype=np.int64)

    def source_counts(self, lo: int, hi: int) -> np.ndarray:
        """Samples each source contributes to positions [lo, hi)."""
        if self.blend is None:
            return np.array([hi - lo], dtype=np.int64)
        return np.bincount(np.asarray(self.blend.dataset_index[lo:hi]),
                           minlength=len(self.datasets)).astype(np.int64)

    def sample(self, position: int) -> dict[str, Any]:
        if self.blend is not None:
            got = self.blend[int(position)]
            got.pop("dataset_id", None)
            return got
        return self.datasets[0][int(position)]

    def with_reset_eod(self, eod: int) -> IndexedSplit:
        """This split with position ids restarting after every ``eod`` token
        (``data.reset_at_eod``: Megatron-LM's --reset-position-ids --reset-attention-mask, the
        boundaries read off the position ids by the model)."""
        out = copy.copy(self)
        out.reset_eod = int(eod)
        return out

    def batch(self, positions) -> dict[str, Any]:
        """Tensors for one micro-batch, as ``TokenizedSplit.batch``: tokens/labels/position_ids
        int64 [b, s], loss_mask float32 [b, s]; a position of -1 is a filler sample (position
        0's tokens, nothing counted)."""
        import torch

        pos = np.asarray(positions, dtype=np.int64)
        samples = [self.sample(p) for p in np.where(pos < 0, 0, pos).tolist()]
        out = {k: torch.stack([s[k] for s in samples]).to(
                   torch.float32 if k == "loss_mask" else torch.int64)
               for k in ("tokens", "labels", "loss_mask", "position_ids")}
        out["loss_mask"][torch.from_numpy(pos < 0)] = 0.0
        if self.reset_eod is not None:
            out["position_ids"] = torch.from_numpy(
                segments.eod_positions(out["tokens"].numpy(), self.reset_eod))
        return out

    def loss_tokens(self, positions) -> int:
        """Loss tokens of the samples at ``positions`` (-1: a filler sample, none)."""
        pos = np.asarray(positions, dtype=np.int64)
        return int(sum(float(self.sample(p)["loss_mask"].sum()) for p in pos[pos >= 0].tolist()))


def _blended(datasets: Sequence, weights: Sequence, size: int | None, cache: str | None):
    from megatron.core.datasets.blended_dataset import BlendedDataset

    from toolkit.train.data.gpt_sources import gpt_config

    config = gpt_config(datasets[0].gpt.config.sequence_length if isinstance(datasets[0], Endless)
                        else datasets[0].config.sequence_length, 0,
                        _facts_of(datasets[0]), cache)
    with _quiet():
        return BlendedDataset(list(datasets), list(weights), size, config)


def _facts_of(ds):
    gpt = ds.gpt if isinstance(ds, Endless) else ds
    return gpt.config.tokenizer


def _blend_key(datasets: Sequence, weights: Sequence[float], size: int) -> str:
    desc = json.dumps([[d.unique_identifiers for d in datasets], list(map(float, weights)), size],
                      sort_keys=True, default=str)
    return hashlib.sha256(desc.encode()).hexdigest()[:24]


def _blend_collective(datasets: Sequence, weights: Sequence[float], size: int,
                      cache: Path | None):
    """The training blend of ``size`` positions: in memory without a cache or process group,
    else built by rank 0 into ``CACHE/blend/<key>/`` (temporary sibling + rename) and mapped."""
    import torch.distributed as dist

    from toolkit import runtime

    if cache is None or not (dist.is_available() and dist.is_initialized()):
        return _blended(datasets, weights, size, None)
    folder = cache / "blend" / _blend_key(datasets, weights, size)
    with runtime.failing_together():
        if dist.get_rank() == 0 and not folder.is_dir():
            with building_once(folder) as tmp:
                _blended(datasets, weights, size, str(tmp))
    return _blended(datasets, weights, size, str(folder))


class SourceTokens:
    """The tokens each source of a pretraining stream has given to training so far (the
    ``tokens_by_source`` of metrics.jsonl), counted step by step from the blending indices."""

    def __init__(self, split: IndexedSplit, seq_len: int, global_batch: int, start: int):
        self.split, self.seq_len, self.g = split, seq_len, global_batch
        self.counts = split.source_counts(0, start * global_batch)
        names = split.names
        self.names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]

    @classmethod
    def of(cls, split, seq_len: int, global_batch: int, start: int) -> SourceTokens | None:
        """None for splits that are not pretraining streams (SFT)."""
        if not getattr(split, "stream", False):
            return None
        return cls(split, seq_len, global_batch, start)

    def add(self, step: int) -> None:
        self.counts = self.counts + self.split.source_counts(step * self.g, (step + 1) * self.g)

    def totals(self) -> dict[str, int]:
        return {n: int(c) * self.seq_len for n, c in zip(self.names, self.counts, strict=True)}
