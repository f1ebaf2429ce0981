"""How a step's loss is normalised: one place for every loss the engine trains with.

A loss function returns its micro-batch's **share** of the global batch's loss: summing the
shares of every micro-batch of every data-parallel (and context-parallel) rank gives the loss of
the global batch. The denominator is a count over the whole global batch (``StepCounts``,
known before the first forward), so the loss, and its gradient, do not depend on how the global
batch is cut into micro-batches, accumulation steps, data-parallel ranks or packed rows:

- ``token_mean`` (pretraining, SFT): the sum of the token losses the loss mask keeps, over the
  loss tokens of the global batch (transformers' fix of the gradient-accumulation bias, 2024).
  The mean of per-micro-batch means it replaces weighted a token of a short row more than one
  of a long row: on 28 skewed validation rows, 6.5513 instead of 6.5627 (docs/training.md).
- ``sample_mean`` (per-sample losses, e.g. one value per preference pair): the sum over the
  micro-batch's samples over the samples of the global batch; never token-weighted.

The engine (``train.engine``) counts, scales the share for megatron-core's schedule and
DeepSpeed's data-parallel average (``backward_scale``) and sums the shares into the reported
loss. The validation loss uses the same rule over the whole validation set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from toolkit import runtime

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepCounts:
    """What a share is a share of: counts over the whole global batch (every micro-batch of
    every data-parallel rank), the same on every rank."""

    loss_tokens: float  # tokens whose loss counts (the loss mask's sum; every label if no mask)
    samples: int  # rows
    num_microbatches: int  # this rank's micro-batches in the step
    dp: int  # data-parallel ranks (without context parallelism)

    @property
    def backward_scale(self) -> float:
        """What a share is multiplied by before backward: megatron-core's schedule divides the
        loss by ``num_microbatches`` (and multiplies by cp) and DeepSpeed averages gradients
        over dp x cp; the product of both is then the gradient of the global loss."""
        return float(self.num_microbatches * self.dp)


#: ``loss_fn(per_token_loss, batch, counts) -> share`` (see the module doc).
LossFn = Callable[[torch.Tensor, Batch, StepCounts], torch.Tensor]


def loss_tokens(batch: Batch) -> float:
    """Loss tokens of one (full-length, before any CP split) micro-batch."""
    mask = batch.get("loss_mask")
    return float(mask.sum()) if mask is not None else float(batch["labels"].numel())


def count_step(batches: Sequence[Batch], *, tokens: float | None = None) -> StepCounts:
    """The counts of the global batch whose share on this rank is ``batches`` (one all-reduce
    over the data-parallel group, when dp > 1). ``tokens``: the global loss-token count when the
    caller knows it already (no reduction of it)."""
    local = torch.tensor([sum(loss_tokens(b) for b in batches) if tokens is None else 0.0,
                          float(sum(len(b["labels"]) for b in batches))], dtype=torch.float64)
    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if dp > 1:
        local = local.to(runtime.device())
        dist.all_reduce(local, group=ps.get_data_parallel_group(with_context_parallel=False))
        local = local.cpu()
    total = float(local[0]) if tokens is None else float(tokens)
    return StepCounts(loss_tokens=total, samples=int(local[1]),
                      num_microbatches=len(batches), dp=dp)


def token_mean(per_token: torch.Tensor, batch: Batch, counts: StepCounts) -> torch.Tensor:
    """This micro-batch's (this CP rank's part of it) share of the token-weighted mean loss."""
    per_token = per_token.float()
    mask = batch.get("loss_mask")
    kept = per_token if mask is None else per_token * mask.to(per_token.dtype)
    return kept.sum() / max(counts.loss_tokens, 1.0)


def sample_mean(per_sample: torch.Tensor, counts: StepCounts,
                samples: int | None = None) -> torch.Tensor:
    """This micro-batch's share of a per-sample mean (``samples``: the global batch's count of
    what ``per_sample`` holds one value of, when that is not its rows, e.g. pairs)."""
    return per_sample.float().sum() / float(samples or counts.samples)


def reduce_shares(shares: Sequence[torch.Tensor], num_microbatches: int) -> float:
    """The step's loss on every rank: the last stage's shares summed over micro-batches and
    over data-parallel x context-parallel ranks, then sent along the pipeline."""
    device = runtime.device()
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        if len(shares) != num_microbatches:
            raise RuntimeError(f"schedule returned {len(shares)} losses for "
                               f"{num_microbatches} micro-batches")
        total += sum(s.double().to(device) for s in shares)
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return total.item()
