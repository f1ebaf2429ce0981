"""What a prepared dataset hands the trainer: the samples of a split and the cache they came
from. Apart from the cache so that every way of preparing data (the .npy cache, the Megatron
indexed pretraining stream) can return it without importing the other."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.train.data import segments
from toolkit.train.data.settings import DataError

#: Per-sample values a micro-batch carries as [samples] float32 tensors (0 for a filler): a
#: reward pair's ``margin``, KTO's ``label``.
PER_SAMPLE = ("margin", "label")


@dataclass
class TokenizedSplit:
    """Fixed-length samples: ``tokens`` [N, seq_len+1] int32, ``loss_mask`` [N, seq_len] uint8;
    or [N, rows, ...] when a sample is several rows (DPO: chosen, rejected). For SFT, where the
    examples sit (``extra``: ``examples`` / ``row_offsets``, ``data.segments``). ``packed``:
    rows hold several examples, kept apart by position ids that restart at each; ``reset_eod``:
    an EOD id after which position ids restart (``data.reset_at_eod``)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    packed: bool = False
    reset_eod: int | None = None

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
        sample's second row (DPO: the chosen rows, then the rejected rows, as TRL batches them),
        and the samples' ``PER_SAMPLE`` values. An index of -1 is a filler sample (sample 0's
        tokens, nothing counted): validation fills its last round with them so that every
        sample is evaluated once at any micro-batch x dp."""
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        filler = idx < 0
        tokens = np.asarray(self.tokens[np.where(filler, 0, idx)], dtype=np.int64)
        mask = np.asarray(self.loss_mask[np.where(filler, 0, idx)], dtype=np.float32)
        mask[filler] = 0.0
        if tokens.ndim == 3:
            tokens = tokens.transpose(1, 0, 2).reshape(-1, tokens.shape[-1])
            mask = mask.transpose(1, 0, 2).reshape(-1, mask.shape[-1])
        rows, seq = tokens.shape[0], tokens.shape[1] - 1
        if self.packed:
            pos = segments.packed_positions(self.extra["examples"], self.extra["row_offsets"],
                                            idx, seq)
        elif self.reset_eod is not None:
            pos = segments.eod_positions(tokens[:, :-1], self.reset_eod)
        else:
            pos = np.broadcast_to(np.arange(seq, dtype=np.int64), (rows, seq))
        t = torch.from_numpy(tokens)
        per_sample = {k: torch.from_numpy(np.where(filler, 0, np.asarray(
            self.extra[k][np.where(filler, 0, idx)])).astype(np.float32))
            for k in PER_SAMPLE if k in self.extra}
        return {
            "tokens": t[:, :-1].contiguous(),
            "labels": t[:, 1:].contiguous(),
            "loss_mask": torch.from_numpy(np.ascontiguousarray(mask)),
            "position_ids": torch.from_numpy(np.array(pos, dtype=np.int64)),
            **per_sample,
        }

    def loss_tokens(self, indices: Sequence[int] | np.ndarray) -> int:
        """Loss tokens of the samples ``indices`` (-1: a filler sample, none)."""
        idx = np.asarray(indices, dtype=np.int64)
        idx = idx[idx >= 0]
        return int(np.asarray(self.loss_mask[np.sort(idx)], dtype=np.int64).sum())


@dataclass
class PreparedData:
    train: TokenizedSplit
    validation: TokenizedSplit | None
    key: str  # cache key: also the data fingerprint a checkpoint records
    path: Path
    meta: dict[str, Any]


def with_reset_at_eod(data: PreparedData, reset: bool, scan: int = 1 << 20) -> PreparedData:
    """``data`` whose splits restart position ids (and so attention) after every EOS token
    (``data.reset_at_eod``); unchanged when ``reset`` is false. Refused when there is no EOS id
    or the first ``scan`` training tokens hold none (documents could not be told apart)."""
    if not reset:
        return data
    eos = data.meta.get("eos_id")
    if eos is None:
        raise DataError("data.reset_at_eod=true needs an EOS token to find document ends, but "
                        "the data has none: use a tokenizer with an EOS token (or set "
                        "data.reset_at_eod=false).")
    seq = int(data.meta["settings"]["seq_len"]) + 1
    rows = max(1, min(scan // seq, len(data.train) if isinstance(data.train, TokenizedSplit)
                      else 64))
    first = data.train.batch(np.arange(rows))
    if not bool((first["tokens"] == eos).any()):
        raise DataError(f"data.reset_at_eod=true but the first {rows} training samples hold no "
                        f"EOS token (id {eos}): the documents are not separated by EOS, so "
                        "they cannot be kept apart; append EOS to every document when "
                        "tokenising, or set data.reset_at_eod=false.")

    def reset(split):
        if split is None:
            return None
        if dataclasses.is_dataclass(split):
            return dataclasses.replace(split, reset_eod=int(eos))
        return split.with_reset_eod(int(eos))

    return dataclasses.replace(data, train=reset(data.train), validation=reset(data.validation))
