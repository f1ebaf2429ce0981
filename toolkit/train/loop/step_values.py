"""A step's values (loss, the objective's metrics, grad norm) without a blocking collective per
step: ``PendingStep`` keeps them on the device, unreduced, and ``resolve_steps`` turns any number
of steps into ``StepResult``s with one all-reduce per group and one copy to the host.

On a GPU each host read of a device value waits for the queue to drain, so a value read every
step leaves the GPU idle while the host launches the next step's first kernels; with one read
per ``logging.interval`` the host runs ahead. The values are the same either way (tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from toolkit import runtime
from toolkit.train.loop.loss import reduce_values


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step produced, identical on every rank."""

    loss: float  # the global batch's loss (``toolkit.train.loop.loss``: token-weighted by default)
    grad_norm: float | None  # global norm DeepSpeed computed before clipping (None: not known)
    lr: float  # learning rate the update used
    skipped: bool  # True when DeepSpeed skipped the update (fp16 overflow)
    num_microbatches: int
    loss_tokens: float = 0.0  # loss tokens in the global batch
    metrics: dict[str, float] = field(default_factory=dict)  # the loss_fn's metric_names


@dataclass(frozen=True)
class PendingStep:
    """A step whose values are still this rank's unreduced shares on the device."""

    shares: torch.Tensor  # ``loss.local_shares``: float64, one value per name
    names: tuple[str, ...]  # "loss" first, then the loss_fn's metric names
    grad_norm: torch.Tensor | float | None  # already global (DeepSpeed reduced it)
    lr: float
    skipped: bool
    num_microbatches: int
    loss_tokens: float


def resolve_steps(steps: Sequence[PendingStep]) -> list[StepResult]:
    """The steps' values on every rank, in order; FloatingPointError for a non-finite loss
    (the first such step named)."""
    if not steps:
        return []
    device = runtime.device()
    width = len(steps[0].names)
    if any(len(s.names) != width for s in steps):
        raise ValueError("steps of one resolution must report the same values")
    shares = torch.stack([s.shares.to(device) for s in steps])
    values = reduce_values(shares)
    norms = _norms(steps, device)
    out = []
    for i, s in enumerate(steps):
        named = dict(zip(s.names, values[i * width:(i + 1) * width], strict=True))
        loss = named.pop("loss")
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss}")
        out.append(StepResult(loss=loss, grad_norm=norms[i], lr=s.lr, skipped=s.skipped,
                              num_microbatches=s.num_microbatches, loss_tokens=s.loss_tokens,
                              metrics=named))
    return out


def _norms(steps: Sequence[PendingStep], device: torch.device) -> list[float | None]:
    """The grad norms as floats, the ones still on the device read back in one copy."""
    out: list = [s.grad_norm for s in steps]
    held = [i for i, v in enumerate(out) if isinstance(v, torch.Tensor)]
    if held:
        read = torch.stack([out[i].reshape(()).to(device, torch.float64) for i in held])
        for i, value in zip(held, read.tolist(), strict=True):
            out[i] = value
    return [None if v is None else float(v) for v in out]
