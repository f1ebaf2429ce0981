"""The GRPO family's loss, as TRL's ``GRPOTrainer._compute_loss`` computes it.

Per completion token: the policy's log-probability ``logp`` of the sampled token (logits at the
sampling temperature), the ratio to the log-probabilities the completions were sampled under
(``old_logps``: computed before the first update when a generation batch serves several steps;
else ``logp`` detached, as TRL), per token or, GSPO (``importance_sampling_level: sequence``),
its mean over the completion. Clipped losses (grpo, bnpo, dr_grpo, dapo):
``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)``; cispo: ``-min(r, eps_high).detach() A logp``;
times TRL's correction of the sampler's mismatch where it applies (``sampling_ratio``); plus
``beta`` times the k3 KL to the reference ``exp(ref - logp) - (ref - logp) - 1``, times the
ratio when ``use_bias_correction_kl`` (TRL's default: the KL's importance-sampling correction).

Normalisation, TRL's per loss type (a micro-batch of ``b`` rows; ``M`` micro-batches in the
global batch, over every data-parallel rank): grpo: the mean over rows of each row's token mean,
over ``M``; bnpo: the micro-batch's token mean, over ``M``; dr_grpo: the micro-batch's token sum
over ``b x max_completion_length``, over ``M``; dapo and cispo: the token sum over the global
batch's completion tokens. So grpo, dr_grpo, dapo and cispo do not depend on how the batch is
cut; bnpo depends on the micro-batch size, as in TRL.

Metrics are token means over the global batch (TRL's per micro-batch, averaged: the same for one
micro-batch per step); a generation batch's values (rewards, lengths) ride on every row as
``batch["batch_metrics"]`` and are reported as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from toolkit.train.loop.loss import StepCounts
from toolkit.train.objectives.distill import (
    _real_columns,
    _tp_sum,
    first_column,
    vocab_log_softmax,
)
from toolkit.train.objectives.grpo.spec import GAP, IS_RATIO


def token_logps(logits: torch.Tensor, labels: torch.Tensor, vocab: int,
                temperature: float = 1.0, entropy: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities of ``labels`` [b, s] under ``logits / temperature`` (this
    tp rank's vocabulary columns [b, s, V/tp]), and the distribution's entropy (no gradient)."""
    width = logits.shape[-1]
    x = _real_columns(logits, vocab)
    if temperature != 1.0:
        x = x / temperature
    lsm = vocab_log_softmax(x)
    first = first_column(width)
    local = labels.to(lsm.device) - first
    inside = (local >= 0) & (local < lsm.shape[-1])
    picked = lsm.gather(-1, local.clamp(0, max(lsm.shape[-1] - 1, 0)).unsqueeze(-1))
    logp = _tp_sum(picked.squeeze(-1) * inside)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = _tp_sum(-(lsm.exp() * lsm).sum(dim=-1))
    return logp, ent


def sampling_ratio(old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, mode: str,
                   low: float | None, high: float | None) -> torch.Tensor:
    """TRL's importance-sampling correction of the sampler's mismatch (``vllm_importance_
    sampling_*``): ``exp(old - sampled)`` over the completion's tokens [b, s], or of their sum
    per row [b, 1] (``sequence_*``); ``*_truncate`` clamps it to [low, high], ``*_mask`` sets
    it to 0 outside."""
    diff = (old - sampled) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    lo = -math.inf if low is None else low
    hi = math.inf if high is None else high
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@dataclass(frozen=True)
class GrpoLoss:
    """``loss_fn(logits [b, s, V/tp], batch, counts)``. The batch: ``labels``, ``loss_mask``
    (completion tokens), ``advantages`` [b], optional ``old_logps`` / ``ref_logps`` /
    ``sampling_logps`` [b, s], ``batch_metrics`` [b, k]."""

    loss_type: str
    vocab: int
    metric_names: tuple[str, ...]
    batch_names: tuple[str, ...]  # the metrics carried in batch["batch_metrics"], in order
    temperature: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    sequence_level: bool = False
    max_completion_length: int = 512
    bias_correction_kl: bool = True
    wants_logits = True

    def __call__(self, logits: torch.Tensor, batch: dict[str, torch.Tensor],
                 counts: StepCounts):
        logp, entropy = token_logps(logits, batch["labels"], self.vocab, self.temperature,
                                    entropy=True)
        mask = batch["loss_mask"].to(logp)
        adv = batch["advantages"].to(logp).unsqueeze(1)
        old = batch["old_logps"].to(logp) if "old_logps" in batch else logp.detach()
        log_ratio = logp - old
        if self.sequence_level:
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1 = torch.exp(log_ratio)
        kl = None
        if self.beta != 0.0:
            ref = batch["ref_logps"].to(logp)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            if self.bias_correction_kl:  # TRL's use_bias_correction_kl (its default)
                kl = kl * coef_1
        if self.loss_type == "cispo":
            per_token = -torch.clamp(coef_1, max=self.epsilon_high).detach() * adv * logp
        else:
            coef_2 = torch.clamp(coef_1, 1 - self.epsilon, 1 + self.epsilon_high)
            per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        if "is_ratio" in batch:  # TRL: the sampler's mismatch corrected before the KL term
            per_token = per_token * batch["is_ratio"].to(logp)
        if kl is not None:
            per_token = per_token + self.beta * kl
        share = self._share(per_token * mask, mask, counts)
        return share, self._metrics(share, coef_1, adv, kl, entropy, logp, mask, batch, counts)

    def _share(self, kept: torch.Tensor, mask: torch.Tensor, counts: StepCounts) -> torch.Tensor:
        micro = float(counts.num_microbatches * counts.dp)
        if self.loss_type == "grpo":
            return (kept.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / micro
        if self.loss_type == "bnpo":
            return kept.sum() / mask.sum().clamp(min=1.0) / micro
        if self.loss_type == "dr_grpo":
            return kept.sum() / (kept.shape[0] * self.max_completion_length) / micro
        return kept.sum() / max(counts.loss_tokens, 1.0)  # dapo, cispo

    def _metrics(self, share, coef_1, adv, kl, entropy, logp, mask, batch, counts):
        with torch.no_grad():
            tokens = max(counts.loss_tokens, 1.0)
            rows = float(mask.shape[0] * counts.num_microbatches * counts.dp)

            def mean(x: torch.Tensor) -> torch.Tensor:  # a token (or, GSPO, a row) mean
                if x.shape[-1] == 1 and mask.shape[-1] != 1:
                    return x.float().sum() / rows
                return (x.float() * mask).sum() / tokens

            out = {"loss": share.detach(), "entropy": mean(entropy)}
            if kl is not None:
                out["kl"] = mean(kl)
            if self.loss_type == "cispo":
                out["cispo_clip_ratio"] = mean((coef_1 > self.epsilon_high) & (adv > 0))
            else:
                low = (coef_1 < 1 - self.epsilon) & (adv < 0)
                high = (coef_1 > 1 + self.epsilon_high) & (adv > 0)
                out.update({"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                            "clip_ratio/region_mean": mean(low | high)})
            if GAP in self.metric_names:  # the trainer's forward when the batch was made
                mine = batch["old_logps"].to(logp) if "old_logps" in batch else logp
                out[GAP] = mean((mine - batch["sampling_logps"].to(logp)).abs())
            if IS_RATIO in self.metric_names:
                out[IS_RATIO] = mean(batch["is_ratio"].to(logp))
            micro = float(counts.num_microbatches * counts.dp)
            values = batch["batch_metrics"][0].to(share.device) / micro
            out.update(zip(self.batch_names, values, strict=True))
        return out
