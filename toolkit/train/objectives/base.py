"""What the training loop asks of a run's data mode: the micro-batches of an optimizer step or
an evaluation, the loss function the engine reduces them with, and how many rows a sample has.
``Objective`` is pretraining's and SFT's (one row per sample, the masked mean token loss); DPO's
is ``toolkit.train.objectives.dpo.objective.DpoObjective`` (two rows, reference log-probabilities
attached, the DPO loss and TRL's metrics). Loss functions return shares of the global batch's
loss (``toolkit.train.loop.loss``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from toolkit.train.loop.loss import LossFn, token_mean


class Objective:
    rows_per_sample = 1
    shown_metrics: tuple[str, ...] = ()  # beside the loss in the progress bar (GRPO: reward)
    loss_fn: LossFn = staticmethod(token_mean)

    def batches(self, split_name: str, split: Any, index_lists: Sequence[np.ndarray],
                ) -> Iterator[dict[str, Any]]:
        """The micro-batches (tensor dicts) of ``index_lists`` of ``split`` (``split_name``:
        train or validation), in order."""
        return (split.batch(i) for i in index_lists)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(getattr(self.loss_fn, "metric_names", ()))

    def close(self) -> None:
        """Free what the objective holds (a reference model)."""
