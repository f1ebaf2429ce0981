"""The DPO loss of one micro-batch, as megatron-core's schedule calls it: per-token
cross-entropy of 2b rows (b chosen, then b rejected) -> per-sequence log-probabilities of the
completions -> the configured per-pair loss (``losses.LOSSES``), its mean over the b pairs, and
TRL's metrics.

The engine's loss functions return shares (``toolkit.train.loop.loss``): here the sum of the
micro-batch's per-pair losses over the pairs of the whole global batch (``sample_mean``, never
token-weighted), so the step's loss is the mean over the global batch's pairs, as TRL's
``DPOTrainer`` computes it, for any micro_batch, accumulation and dp; the metrics likewise.
A pair without completion tokens (a filler of the last validation round) counts for nothing.

Context parallelism: each rank holds part of every sequence, so its log-probabilities are
partial sums. They are completed over the CP group (all-reduce) with the gradient flowing only
through the rank's own part, so each rank holds the whole loss L and its backward gives the
rank's share of dL/dθ. megatron-core multiplies the loss by cp before backward and DeepSpeed
averages the gradients over dp x cp: the sum of the shares, dL/dθ, as without CP. The values the
engine reports are summed over the CP group, so they are divided by cp (the loss reported as
L / cp, not the one differentiated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from toolkit.train.loop.loss import StepCounts, sample_mean
from toolkit.train.objectives.dpo.losses import LOSSES, Pairs
from toolkit.train.objectives.dpo.spec import METRICS


def sequence_logps(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of log-probabilities over each row's masked labels; whole sequences under CP (the
    other ranks' parts enter as constants)."""
    return sequence_sum(-per_token.float(), mask)


def sequence_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's sum of ``values`` [rows, s] over its masked positions; whole sequences under
    CP (the other ranks' parts enter as constants, the gradient flows through this rank's)."""
    part = (values.float() * mask).sum(dim=1)
    if ps.get_context_parallel_world_size() == 1:
        return part
    whole = part.detach().clone()
    dist.all_reduce(whole, group=ps.get_context_parallel_group())
    return part + (whole - part.detach())


def token_counts(mask: torch.Tensor) -> torch.Tensor:
    count = mask.sum(dim=1)
    if ps.get_context_parallel_world_size() > 1:
        count = count.clone()
        dist.all_reduce(count, group=ps.get_context_parallel_group())
    return count


@dataclass(frozen=True)
class DpoLoss:
    """``loss_fn(per_token, batch, counts) -> (share, metrics)`` of the engine;
    ``batch['ref_logps']`` holds the reference log-probabilities of the 2b rows."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    metric_names = METRICS  # what the engine sums besides the loss, as shares

    def __call__(self, per_token: torch.Tensor, batch: dict[str, torch.Tensor],
                 counts: StepCounts):
        mask = batch["loss_mask"].to(torch.float32)
        logps = sequence_logps(per_token, mask)
        ref = batch["ref_logps"].to(logps)
        tokens = token_counts(mask)
        pairs = Pairs(*logps.chunk(2), *ref.chunk(2), *tokens.chunk(2))
        real = (pairs.chosen_tokens > 0).to(logps.dtype)  # filler pairs count for nothing
        n = max(counts.samples // 2, 1)  # the global batch's pairs
        share = sample_mean(real * LOSSES[self.loss](pairs, self.beta, self.label_smoothing),
                            counts, n)
        cp = ps.get_context_parallel_world_size()
        reported = {"loss": share.detach(), **self.metrics(pairs, real, counts, n)}
        return share, {k: v / cp for k, v in reported.items()}

    def metrics(self, p: Pairs, real: torch.Tensor, counts: StepCounts,
                n: int) -> dict[str, torch.Tensor]:
        """TRL's names, as shares of their means over the global batch's pairs."""
        with torch.no_grad():
            chosen, rejected = self.beta * p.chosen_ratio, self.beta * p.rejected_ratio
            values = {"rewards/chosen": chosen, "rewards/rejected": rejected,
                      "rewards/margins": chosen - rejected,
                      "rewards/accuracies": (chosen > rejected).float(),
                      "logps/chosen": p.chosen.detach(), "logps/rejected": p.rejected.detach()}
            return {k: sample_mean(real * v, counts, n) for k, v in values.items()}
