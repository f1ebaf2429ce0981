"""Learning-rate schedule as a pure function of the optimizer step.

No scheduler object carries state between steps, so a resumed run computes exactly the same LR as
the uninterrupted one from the step number alone (nothing to save, nothing to get out of sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("cosine", "linear", "constant")


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
          decay: str) -> float:
    """LR for 0-based optimizer step ``step`` (the update being taken).

    Warmup: ``lr * (step + 1) / warmup_steps`` for the first ``warmup_steps`` steps, so the first
    update is not wasted at LR 0 and step ``warmup_steps - 1`` reaches ``lr``. Then, with
    ``progress = (step + 1 - warmup_steps) / (total_steps - warmup_steps)`` clamped to [0, 1]
    (so the last step, ``total_steps - 1``, reaches ``min_lr``):
    cosine ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2``;
    linear ``lr - (lr - min_lr) * progress``; constant ``lr``.
    """
    if decay not in DECAYS:
        raise ValueError(f"decay={decay!r}: choose one of {', '.join(DECAYS)}.")
    if step < 0:
        raise ValueError(f"step={step} must be >= 0.")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    span = total_steps - warmup_steps
    progress = 1.0 if span <= 0 else min(1.0, (step + 1 - warmup_steps) / span)
    if decay == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LRSchedule:
    """The schedule of one run; ``schedule(step)`` gives the LR of that 0-based step."""

    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    decay: str = "cosine"

    @classmethod
    def from_config(cls, optim, total_steps: int) -> LRSchedule:
        """From a ``config.OptimSection`` and the run's total optimizer steps."""
        return cls(lr=optim.lr, min_lr=optim.min_lr, warmup_steps=optim.warmup_steps,
                   total_steps=total_steps, decay=optim.decay)

    def __call__(self, step: int) -> float:
        return lr_at(step, lr=self.lr, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                     total_steps=self.total_steps, decay=self.decay)

    def apply(self, optimizer, step: int) -> float:
        """Set every param group's LR for ``step`` (call before ``optimizer.step()``)."""
        value = self(step)
        for group in optimizer.param_groups:
            group["lr"] = value
        return value
