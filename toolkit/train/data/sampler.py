"""Which samples each data-parallel rank reads at each optimizer step (``GlobalBatchSampler``),
and the in-order validation micro-batches."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from toolkit.train.data.settings import DataError
from toolkit.train.data.split import TokenizedSplit


@functools.lru_cache(maxsize=4)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


@dataclass(frozen=True)
class GlobalBatchSampler:
    """Which samples each data-parallel rank reads at each optimizer step (see module doc).

    Rank ``r`` reads the contiguous share ``[r*G/dp, (r+1)*G/dp)`` of the step's global batch,
    split into ``grad_accum`` micro-batches of ``micro_batch`` samples, in order.
    """

    num_samples: int
    global_batch: int
    micro_batch: int
    dp_size: int
    dp_rank: int
    seed: int
    shuffle: bool = True

    # Resuming with another dp (same global batch) reproduces every global batch.
    supports_dp_change = True

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise DataError("the training set is empty.")
        if not 0 <= self.dp_rank < self.dp_size:
            raise DataError(f"dp_rank={self.dp_rank} outside dp_size={self.dp_size}.")
        if self.global_batch % (self.micro_batch * self.dp_size):
            raise DataError(f"global_batch={self.global_batch} is not divisible by micro_batch * "
                            f"dp = {self.micro_batch} * {self.dp_size}.")

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def consumed_samples(self, steps: int) -> int:
        return steps * self.global_batch

    def epoch(self, step: int) -> float:
        """Epochs completed before ``step`` (fractional)."""
        return step * self.global_batch / self.num_samples

    def global_indices(self, step: int) -> np.ndarray:
        """Sample indices of the whole global batch of 0-based optimizer step ``step``."""
        stream = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        epochs, pos = np.divmod(stream, self.num_samples)
        if not self.shuffle:  # in order: no index array of the whole set
            return pos
        out = np.empty_like(stream)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = _epoch_order(self.num_samples, self.seed, int(e))[pos[sel]]
        return out

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's ``grad_accum`` micro-batches (index arrays) for step ``step``."""
        share = self.global_batch // self.dp_size
        mine = self.global_indices(step)[self.dp_rank * share:(self.dp_rank + 1) * share]
        return [mine[i:i + self.micro_batch] for i in range(0, share, self.micro_batch)]


def step_batches(split: TokenizedSplit, sampler: GlobalBatchSampler, step: int,
                 ) -> Iterator[dict[str, Any]]:
    """This rank's micro-batches of optimizer step ``step`` as tensor dicts (the
    ``data_iterator`` of one training step)."""
    for indices in sampler.micro_batches(step):
        yield split.batch(indices)


def eval_micro_batches(num_samples: int, micro_batch: int, dp_size: int, dp_rank: int,
                       max_batches: int | None = None, multiple: int = 1) -> list[np.ndarray]:
    """Validation in order, ``micro_batch * dp`` samples per round, rank ``r`` taking the r-th
    micro-batch of each round. The last round is completed with filler rows (index -1, nothing
    counted: ``TokenizedSplit.batch``), so every rank runs the same number of micro-batches and
    every sample is evaluated once, at any micro_batch x dp. ``max_batches`` caps the rounds;
    ``multiple``: filler rounds are added up to a multiple of it (the interleaved pipeline
    schedule wants a multiple of pp)."""
    if num_samples < 1:
        raise DataError("the validation set is empty: add validation data or raise "
                        "data.validation_split.")
    per_round = micro_batch * dp_size
    rounds = -(-num_samples // per_round)
    if max_batches is not None:
        rounds = min(rounds, max_batches)
    start = dp_rank * micro_batch
    out = []
    for r in range(-(-rounds // multiple) * multiple):
        idx = np.arange(r * per_round + start, r * per_round + start + micro_batch)
        out.append(np.where(idx < num_samples, idx, -1))
    return out


def eval_rows(num_samples: int, micro_batch: int, dp_size: int,
              max_batches: int | None = None) -> np.ndarray:
    """Every sample the validation rounds of all ranks evaluate (``eval_micro_batches``)."""
    per_round = micro_batch * dp_size
    rounds = -(-num_samples // per_round)
    if max_batches is not None:
        rounds = min(rounds, max_batches)
    return np.arange(min(num_samples, rounds * per_round))
