"""KTO on unpaired feedback (``data.mode: kto``), as TRL's ``KTOTrainer`` computes it.

A row's log-ratio is its completion's summed log-probability under the policy minus under the
reference. KTO compares it with ``kl``, an estimate of KL(policy || reference) from mismatched
pairs: each prompt with another sample's completion (``data.kto.kl_partner``: TRL's rotation
inside a batch), ``kl = max(0, mean(policy - reference log-probabilities of those rows))``,
detached. A desirable row's loss is ``1 - sigmoid(beta (log-ratio - kl))``, an undesirable
row's ``1 - sigmoid(beta (kl - log-ratio))``, weighted by ``desirable_weight`` /
``undesirable_weight``; the step's loss is their mean over the global batch's rows.

TRL estimates ``kl`` over a device's batch (then averages over devices); here over the global
batch, before the step's forward: the reference runs forward over the step's rows and KL rows,
the policy forward (no gradient) over the KL rows, and one all-reduce over data parallelism
gives the mean, attached to every micro-batch. So ``kl``, and the loss, do not depend on how the
global batch is split; TRL's when TRL's batch is the global batch. Validation estimates it over
the whole validation set (TRL's, evaluated as one batch). The KL rows pair samples in chunks of
the global batch in data order, so the data is read in order (``data.shuffle: false``, as TRL
requires sequential sampling).

Metrics, TRL's names: ``kl``, ``rewards/chosen`` and ``logps/chosen`` (means over the global
batch's desirable rows), the ``rejected`` ones (undesirable rows), ``rewards/margins`` (their
difference); a global batch without one kind reports 0 for its means.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state as ps

from toolkit.train.data.kto import kl_batch
from toolkit.train.loop.engine import forward_outputs
from toolkit.train.loop.loss import StepCounts, data_parallel_sums, sample_mean
from toolkit.train.objectives.base import Objective
from toolkit.train.objectives.dpo.loss import sequence_logps, token_counts
from toolkit.train.objectives.dpo.reference import ModelReference, collect_logps
from toolkit.train.objectives.spec import KTO_METRICS


@dataclass(frozen=True)
class KtoLoss:
    """``loss_fn(per_token, batch, counts)``; the batch carries ``label`` (1: desirable),
    ``ref_logps``, ``kl`` and the global batch's ``num_chosen`` / ``num_rejected`` (per row)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    metric_names = KTO_METRICS

    def __call__(self, per_token: torch.Tensor, batch: dict[str, torch.Tensor],
                 counts: StepCounts):
        mask = batch["loss_mask"].to(torch.float32)
        logps = sequence_logps(per_token, mask)
        ratio = logps - batch["ref_logps"].to(logps)
        real = (token_counts(mask) > 0).to(logps.dtype)
        chosen = batch["label"].to(logps) * real
        rejected = (1.0 - batch["label"].to(logps)) * real
        kl = batch["kl"].to(logps)
        losses = (chosen * self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - kl)))
                  + rejected * self.undesirable_weight
                  * (1 - torch.sigmoid(self.beta * (kl - ratio))))
        share = sample_mean(losses, counts)
        with torch.no_grad():
            n_c = batch["num_chosen"][0].clamp(min=1.0)
            n_r = batch["num_rejected"][0].clamp(min=1.0)
            reward = self.beta * ratio.detach()
            values = {"loss": share.detach(), "kl": sample_mean(real * kl, counts),
                      "rewards/chosen": (chosen * reward).sum() / n_c,
                      "rewards/rejected": (rejected * reward).sum() / n_r,
                      "logps/chosen": (chosen * logps.detach()).sum() / n_c,
                      "logps/rejected": (rejected * logps.detach()).sum() / n_r}
            values["rewards/margins"] = values["rewards/chosen"] - values["rewards/rejected"]
            cp = ps.get_context_parallel_world_size()
            reported = {k: v / cp for k, v in values.items()}
        return share, reported


class KtoObjective(Objective):
    """One row per sample; before the policy's schedule, each step's (or evaluation's)
    micro-batches get the reference's log-probabilities, the KL estimate and the global counts
    of desirable and undesirable rows."""

    def __init__(self, loss_fn: KtoLoss, reference: ModelReference,
                 policy: Sequence[torch.nn.Module], chunk: int):
        self.loss_fn, self.reference, self.policy = loss_fn, reference, list(policy)
        self.chunk = chunk  # samples per KL chunk: the global batch

    def batches(self, split_name: str, split: Any, index_lists: Sequence[np.ndarray],
                ) -> Iterator[dict[str, Any]]:
        batches = [split.batch(i) for i in index_lists]
        kl_rows = [kl_batch(split, i, self.chunk) for i in index_lists]
        real = [b["loss_mask"].sum(dim=1) > 0 for b in batches]
        chosen = sum(float((b["label"] * r).sum()) for b, r in zip(batches, real, strict=True))
        n_c, n_all = data_parallel_sums([chosen, float(sum(int(r.sum()) for r in real))])
        ref = self.reference.logps(batches + kl_rows)
        kl = self._kl(kl_rows, ref[len(batches):])
        for i, b in enumerate(batches):
            rows = b["tokens"].shape[0]
            b["ref_logps"] = ref[i] if ref else torch.zeros(rows)
            b["kl"] = torch.full((rows,), kl)
            b["num_chosen"] = torch.full((rows,), n_c)
            b["num_rejected"] = torch.full((rows,), n_all - n_c)
        return iter(batches)

    def _kl(self, kl_rows: list[dict[str, Any]], ref: list[torch.Tensor]) -> float:
        """The global batch's KL estimate (last pipeline stage; 0 elsewhere, unused there)."""
        if not kl_rows:
            return 0.0
        rows = int(kl_rows[0]["tokens"].shape[0])
        out = forward_outputs(self.policy, iter(kl_rows), collect_logps,
                              num_microbatches=len(kl_rows), micro_batch=rows,
                              seq_len=int(kl_rows[0]["tokens"].shape[1]))
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return 0.0
        total, count = 0.0, 0.0
        for b, mine, theirs in zip(kl_rows, out, ref, strict=True):
            real = (b["loss_mask"].sum(dim=1) > 0).to(torch.float64)
            total += float((real * (mine["logps"].double().cpu() - theirs.double().cpu())).sum())
            count += float(real.sum())
        total, count = data_parallel_sums([total, count])
        return max(total / max(count, 1.0), 0.0)

    def close(self) -> None:
        self.reference.close()
