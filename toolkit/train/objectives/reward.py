"""A Bradley-Terry reward model (``data.mode: reward``), as TRL's ``RewardTrainer`` trains it.

The model is the policy's with a scalar head in place of its LM head
(``toolkit.models.score_head``); it returns a score per position and the loss reads each
sequence's at its last non-padding token (the micro-batch's mask, ``data.reward``). A pair's
loss is ``-log sigmoid(r_chosen - r_rejected - margin)`` (``margin``: the row's, when the data
gives one) plus ``center_rewards_coefficient * (r_chosen + r_rejected)^2``; the step's loss is
the mean over the global batch's pairs (``sample_mean``), TRL's when TRL's batch is the global
batch. Metrics, TRL's names: ``accuracy`` (chosen scored above rejected), ``margin``
(r_chosen - r_rejected) and ``mean_reward``, means over the pairs (TRL's min and max rewards
are not sums of shares: left out). Under context parallelism the scored position lies on one
rank: each row's score is completed over the CP group as DPO's log-probabilities are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from toolkit.train.loop.loss import StepCounts, sample_mean
from toolkit.train.objectives.base import Objective
from toolkit.train.objectives.dpo.loss import sequence_sum, token_counts
from toolkit.train.objectives.spec import REWARD_METRICS


@dataclass(frozen=True)
class RewardLoss:
    """``loss_fn(scores [2b, s, 1], batch, counts)``: chosen rows first, then rejected."""

    center_rewards_coefficient: float | None = None
    metric_names = REWARD_METRICS
    wants_logits = True  # the head's scores, not a cross-entropy

    def __call__(self, scores: torch.Tensor, batch: dict[str, torch.Tensor],
                 counts: StepCounts):
        mask = batch["loss_mask"].to(torch.float32)
        rewards = sequence_sum(scores[..., 0], mask)
        chosen, rejected = rewards.chunk(2)
        real = (token_counts(mask).chunk(2)[0] > 0).to(rewards.dtype)  # filler pairs: none
        margin = batch.get("margin")
        shift = margin.to(rewards) if margin is not None else 0.0
        pair = -F.logsigmoid(chosen - rejected - shift)
        if self.center_rewards_coefficient is not None:
            pair = pair + self.center_rewards_coefficient * (chosen + rejected) ** 2
        n = max(counts.samples // 2, 1)  # the global batch's pairs
        share = sample_mean(real * pair, counts, n)
        with torch.no_grad():
            values = {"loss": pair, "accuracy": (chosen > rejected).float(),
                      "margin": chosen - rejected, "mean_reward": (chosen + rejected) / 2}
            cp = ps.get_context_parallel_world_size()
            reported = {k: sample_mean(real * v.detach(), counts, n) / cp
                        for k, v in values.items()}
        return share, reported


class RewardObjective(Objective):
    """Two rows per sample (chosen, rejected), the pair's margin beside them."""

    rows_per_sample = 2

    def __init__(self, loss_fn: RewardLoss):
        self.loss_fn = loss_fn
