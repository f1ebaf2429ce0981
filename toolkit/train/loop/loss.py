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
    samples: int  # rows that carry loss (filler rows of a validation round do not)
    num_microbatches: int  # this rank's micro-batches in the step
    dp: int  # data-parallel ranks (without context parallelism)

    @property
    def backward_scale(self) -> float:
        """What a share is multiplied by before backward: megatron-core's schedule divides the
        loss by ``num_microbatches`` (and multiplies by cp) and DeepSpeed averages gradients
        over dp x cp; the product of both is then the gradient of the global loss."""
        return float(self.num_microbatches * self.dp)


#: ``loss_fn(per_token_loss, batch, counts) -> share``, or ``(share, {name: share})`` with
#: the names in the function's ``metric_names``: metrics are shares too (summed like the loss);
#: a "loss" among them replaces the reported loss (not the one differentiated). A loss_fn with
#: ``wants_logits = True`` gets the output layer's values [b, s, n] instead of per-token losses
#: (this rank's vocab columns of the logits; a reward model's scores, n = 1).
LossFn = Callable[[torch.Tensor, Batch, StepCounts],
                  torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]]


def loss_names(loss_fn: LossFn) -> tuple[str, ...]:
    """The values a loss function reports: the loss, then its ``metric_names``."""
    return ("loss", *getattr(loss_fn, "metric_names", ()))


def loss_tokens(batch: Batch) -> float:
    """Loss tokens of one (full-length, before any CP split) micro-batch."""
    mask = batch.get("loss_mask")
    return float(mask.sum()) if mask is not None else float(batch["labels"].numel())


def loss_rows(batch: Batch) -> int:
    """Rows of one micro-batch that carry loss (a filler row has an all-zero mask)."""
    mask = batch.get("loss_mask")
    return int((mask.sum(dim=1) > 0).sum()) if mask is not None else len(batch["labels"])


def count_step(batches: Sequence[Batch], *, tokens: float | None = None,
               samples: int | None = None) -> StepCounts:
    """The counts of the global batch whose share on this rank is ``batches`` (one all-reduce
    over the data-parallel group, when dp > 1 and a count is not given). ``tokens`` /
    ``samples``: the global counts when the caller knows them already."""
    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if tokens is not None and samples is not None:
        return StepCounts(loss_tokens=float(tokens), samples=int(samples),
                          num_microbatches=len(batches), dp=dp)
    local = torch.tensor([sum(loss_tokens(b) for b in batches),
                          float(sum(loss_rows(b) for b in batches))], dtype=torch.float64)
    if dp > 1:
        local = local.to(runtime.device())
        dist.all_reduce(local, group=ps.get_data_parallel_group(with_context_parallel=False))
        local = local.cpu()
    return StepCounts(loss_tokens=float(local[0]) if tokens is None else float(tokens),
                      samples=int(local[1]) if samples is None else int(samples),
                      num_microbatches=len(batches), dp=dp)


def data_parallel_sums(values: Sequence[float]) -> list[float]:
    """``values`` summed over the data-parallel group (without context parallelism: its ranks
    hold the same micro-batches), on every rank of it: a count over the global batch that an
    objective attaches to its micro-batches (one all-reduce)."""
    values = [float(v) for v in values]
    if not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=runtime.device())
    dist.all_reduce(t, group=ps.get_data_parallel_group(with_context_parallel=False))
    return t.cpu().tolist()


def token_mean(per_token: torch.Tensor, batch: Batch, counts: StepCounts) -> torch.Tensor:
    """This micro-batch's (this CP rank's part of it) share of the token-weighted mean loss.
    A 0-d ``per_token`` is the sum the model took itself over the tokens the mask keeps (the
    fused linear cross-entropy: ``accepts_token_sum``)."""
    if per_token.dim() == 0:
        return per_token.float() / max(counts.loss_tokens, 1.0)
    per_token = per_token.float()
    mask = batch.get("loss_mask")
    kept = per_token if mask is None else per_token * mask.to(per_token.dtype)
    return kept.sum() / max(counts.loss_tokens, 1.0)


token_mean.accepts_token_sum = True  # type: ignore[attr-defined]


def sample_mean(per_sample: torch.Tensor, counts: StepCounts,
                samples: int | None = None) -> torch.Tensor:
    """This micro-batch's share of a per-sample mean (``samples``: the global batch's count of
    what ``per_sample`` holds one value of, when that is not its rows, e.g. pairs)."""
    return per_sample.float().sum() / float(samples or counts.samples)


def local_shares(results: Sequence[dict[str, torch.Tensor]], num_microbatches: int,
                 names: Sequence[str] = ("loss",)) -> torch.Tensor:
    """This rank's part of the step's values, no collective: each named share of the last
    stage's micro-batch results summed over its micro-batches (zeros on other stages), float64
    on the device. ``reduce_values`` turns any number of these into the step values."""
    total = torch.zeros(len(names), dtype=torch.float64, device=runtime.device())
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        if len(results) != num_microbatches:
            raise RuntimeError(f"schedule returned {len(results)} losses for "
                               f"{num_microbatches} micro-batches")
        for i, name in enumerate(names):
            total[i] += sum(r[name].double().to(total.device) for r in results)
    return total


def reduce_values(local: torch.Tensor) -> list[float]:
    """``local_shares`` (one row, or stacked rows of several steps) summed over data-parallel x
    context-parallel ranks and sent along the pipeline: the values on every rank, flattened.
    One all-reduce per group and one copy to the host, however many steps."""
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        dist.all_reduce(local, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(local, group=ps.get_pipeline_model_parallel_group())
    return local.reshape(-1).tolist()


def reduce_shares(results: Sequence[dict[str, torch.Tensor]], num_microbatches: int,
                  names: Sequence[str] = ("loss",)) -> dict[str, float]:
    """The step's values on every rank (``local_shares`` then ``reduce_values``)."""
    values = reduce_values(local_shares(results, num_microbatches, names))
    return dict(zip(names, values, strict=True))
