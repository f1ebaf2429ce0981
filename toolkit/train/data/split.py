"""What a prepared dataset hands the trainer: the samples of a split and the cache they came
from. Apart from the cache so that every way of preparing data (the .npy cache, the Megatron
indexed pretraining stream) can return it without importing the other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class TokenizedSplit:
    """Fixed-length samples: ``tokens`` [N, seq_len+1] int32, ``loss_mask`` [N, seq_len] uint8;
    or [N, rows, ...] when a sample is several rows (DPO: chosen, rejected)."""

    tokens: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def rows_per_sample(self) -> int:
        return int(self.tokens.shape[1]) if self.tokens.ndim == 3 else 1

    def reserve(self, num_samples: int) -> None:
        """Nothing to build: every sample is on disk (a pretraining stream builds its blend)."""

    def sampler_args(self, shuffle: bool) -> tuple[int, bool]:
        """(num_samples, shuffle) for ``GlobalBatchSampler``."""
        return len(self), shuffle

    def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, Any]:
        """Tensors for one micro-batch: tokens/labels/position_ids int64 [b, s], loss_mask
        float32 [b, s] (labels are valid ids everywhere; the mask says which count). Samples of
        several rows give b = samples x rows, row by row: every sample's first row, then every
        sample's second row (DPO: the chosen rows, then the rejected rows, as TRL batches them)."""
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        tokens, mask = np.asarray(self.tokens[idx]), np.asarray(self.loss_mask[idx])
        if tokens.ndim == 3:
            tokens = tokens.transpose(1, 0, 2).reshape(-1, tokens.shape[-1])
            mask = mask.transpose(1, 0, 2).reshape(-1, mask.shape[-1])
        t = torch.from_numpy(tokens.astype(np.int64))
        rows, seq = t.shape[0], t.shape[1] - 1
        return {
            "tokens": t[:, :-1].contiguous(),
            "labels": t[:, 1:].contiguous(),
            "loss_mask": torch.from_numpy(mask.astype(np.float32)),
            "position_ids": torch.arange(seq, dtype=torch.int64).expand(rows, seq).clone(),
        }


@dataclass
class PreparedData:
    train: TokenizedSplit
    validation: TokenizedSplit | None
    key: str  # cache key: also the data fingerprint a checkpoint records
    path: Path
    meta: dict[str, Any]
