"""Reference-free preference losses on DPO's pairs (``dpo.loss: orpo | simpo``), as TRL's
``ORPOTrainer`` and ``CPOTrainer(loss_type="simpo")`` compute them: no reference model, so half
the memory of DPO's.

Both read the policy's average completion log-probability of each row (its summed
log-probabilities over its completion tokens, TRL's ``average_log_prob=True``) and add a
negative log-likelihood term on the chosen rows:

- ORPO: ``nll - beta * mean(log sigmoid(log_odds))`` with ``log_odds = (c - r) - (log(1 -
  e^c) - log(1 - e^r))`` (``beta`` is ORPO's lambda, TRL's ``ORPOConfig.beta``); the NLL is
  over the chosen rows' prompt and completion tokens (TRL: "the full prompt and response").
- SimPO: ``mean(-log sigmoid(beta * (c - r) - simpo_gamma)) + cpo_alpha * nll``, the NLL over
  the chosen completions only (TRL's CPO; ``cpo_alpha: 0`` is the SimPO paper).

TRL averages the NLL over the tokens of its batch; here over those of the global batch (each
micro-batch's share: its tokens' sum over the global count, ``nll_tokens``, which the objective
attaches), so the loss does not depend on how the global batch is split; it is TRL's when TRL's
batch is the global batch. The per-pair term is a mean over the global batch's pairs, as DPO's
(``DpoLoss``; under context parallelism the same completion of each row's sum over the CP group).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from toolkit.train.loop.loss import StepCounts, data_parallel_sums, sample_mean
from toolkit.train.objectives.base import Objective
from toolkit.train.objectives.dpo.loss import sequence_logps, token_counts
from toolkit.train.objectives.dpo.spec import METRICS

LN_HALF = -math.log(2.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation (switching at -ln 2)."""
    return torch.where(x < LN_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_pair(c: torch.Tensor, r: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict]:
    """ORPO's per-pair term (to add to the NLL) from average log-probabilities; its logs."""
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    ratio = F.logsigmoid(log_odds)
    return -beta * ratio, {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}


def simpo_pair(c: torch.Tensor, r: torch.Tensor, beta: float, gamma: float,
               ) -> tuple[torch.Tensor, dict]:
    """SimPO's per-pair term (TRL's CPO ``simpo``: ``logits = (c - r) - gamma / beta``)."""
    return -F.logsigmoid(beta * ((c - r) - gamma / beta)), {}


@dataclass(frozen=True)
class RefFreeLoss:
    """``loss_fn(per_token, batch, counts)``: ``batch['nll_mask']`` marks the NLL's tokens,
    ``batch['nll_tokens']`` holds their count over the global batch (per row)."""

    loss: str = "orpo"
    beta: float = 0.1
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0

    @property
    def metric_names(self) -> tuple[str, ...]:
        extra = ("log_odds_ratio", "log_odds_chosen") if self.loss == "orpo" else ()
        return (*METRICS, "nll_loss", *extra)

    @property
    def nll_weight(self) -> float:
        return 1.0 if self.loss == "orpo" else self.cpo_alpha

    def __call__(self, per_token: torch.Tensor, batch: dict[str, torch.Tensor],
                 counts: StepCounts):
        mask = batch["loss_mask"].to(torch.float32)
        tokens = token_counts(mask)  # whole rows under CP
        logps = sequence_logps(per_token, mask) / tokens.clamp(min=1.0)
        c, r = logps.chunk(2)
        real = (tokens.chunk(2)[0] > 0).to(logps.dtype)  # filler pairs count for nothing
        pair, logs = (orpo_pair(c, r, self.beta) if self.loss == "orpo"
                      else simpo_pair(c, r, self.beta, self.simpo_gamma))
        n = max(counts.samples // 2, 1)  # the global batch's pairs
        cp = ps.get_context_parallel_world_size()
        pair_share = sample_mean(real * pair, counts, n)
        nll_share = self._nll(per_token, batch)
        share = pair_share + self.nll_weight * nll_share
        with torch.no_grad():
            chosen, rejected = self.beta * c, self.beta * r
            values = {"rewards/chosen": chosen, "rewards/rejected": rejected,
                      "rewards/margins": chosen - rejected,
                      "rewards/accuracies": (chosen > rejected).float(),
                      "logps/chosen": c, "logps/rejected": r, **logs}
            reported = {k: sample_mean(real * v.detach(), counts, n) / cp
                        for k, v in values.items()}
            reported["loss"] = pair_share.detach() / cp + self.nll_weight * nll_share.detach()
            reported["nll_loss"] = nll_share.detach()
        return share, reported

    def _nll(self, per_token: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's share of the chosen rows' token-mean NLL over the global batch."""
        if not self.nll_weight and self.loss != "orpo":
            return per_token.float().sum() * 0.0
        nll_mask = batch["nll_mask"].to(torch.float32)
        total = batch["nll_tokens"][0].to(torch.float32).clamp(min=1.0)
        return (per_token.float() * nll_mask).sum() / total


def nll_mask(loss_mask: torch.Tensor, full_rows: bool) -> torch.Tensor:
    """The NLL's labels of a micro-batch of 2b rows (chosen first): the chosen completions
    (SimPO), or every label up to each chosen row's last completion token (ORPO: prompt and
    completion); none on the rejected rows."""
    out = torch.zeros_like(loss_mask)
    chosen = loss_mask[: loss_mask.shape[0] // 2]
    if not full_rows:
        out[: chosen.shape[0]] = chosen
        return out
    positions = torch.arange(chosen.shape[1]).expand_as(chosen)
    last = torch.where(chosen > 0, positions, -1).max(dim=1).values
    out[: chosen.shape[0]] = (positions <= last[:, None]).to(out.dtype)
    return out


class RefFreeObjective(Objective):
    """DPO's pairs without a reference: each micro-batch gets its NLL mask and the global batch's
    count of NLL tokens (one all-reduce over data parallelism per step or evaluation)."""

    rows_per_sample = 2

    def __init__(self, loss_fn: RefFreeLoss):
        self.loss_fn = loss_fn

    def batches(self, split_name: str, split: Any, index_lists: Sequence[np.ndarray],
                ) -> Iterator[dict[str, Any]]:
        batches = [split.batch(i) for i in index_lists]
        for b in batches:
            b["nll_mask"] = nll_mask(b["loss_mask"], full_rows=self.loss_fn.loss == "orpo")
        (total,) = data_parallel_sums([sum(float(b["nll_mask"].sum()) for b in batches)])
        for b in batches:
            b["nll_tokens"] = torch.full((b["tokens"].shape[0],), total)
        return iter(batches)
