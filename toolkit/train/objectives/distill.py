"""Knowledge distillation (``data.mode: distill``), as TRL's ``GKDTrainer`` computes it: on the
dataset's completions (``lmbda: 0``) and, with ``lmbda > 0``, on completions the student samples
on the training ranks (``onpolicy``).

A teacher model (``distill.teacher``: frozen, at the student's layout and precision, under ZeRO-3
partitioned like it) runs forward over each step's micro-batches before the student's schedule;
its logits of this rank's vocabulary columns (and, under context parallelism, this rank's part
of each sequence: ``local_teacher_logits``) ride with the micro-batch to the last stage. The
loss of a completion token is GKD's generalized Jensen-Shannon divergence between the two
next-token distributions (``beta`` 0: KL(teacher || student), 1: KL(student || teacher),
between: ``beta KL(teacher || m) + (1 - beta) KL(student || m)`` with ``m = beta teacher + (1 -
beta) student``); the step's loss is its mean over the global batch's completion tokens (TRL's
with its ``num_items_in_batch``). TRL's GKD compares the distributions at temperature 1
(``temperature`` is its sampling temperature).

Under tensor parallelism each rank holds V/tp columns of both logits: the softmax normaliser
and the per-token sums over the vocabulary are all-reduced over the tp group (megatron-core's
``reduce_from_tensor_model_parallel_region``: forward sum, backward identity), as megatron-core's
vocab-parallel cross-entropy does; padded vocab columns are left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from toolkit.train.loop.loss import StepCounts
from toolkit.train.objectives.base import Objective
from toolkit.train.objectives.dpo.reference import ModelReference

TEACHER = "local_teacher_logits"  # already this CP rank's share (``context_parallel_share``)


def _tp() -> int:
    """The tensor-parallel size (1 outside a run: the loss on one process's full vocabulary)."""
    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def first_column(width: int) -> int:
    """The vocabulary id of this tp rank's first logits column (``width`` columns a rank)."""
    return ps.get_tensor_model_parallel_rank() * width if _tp() > 1 else 0


def _real_columns(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """This tp rank's columns that are real tokens (the padding of the last rank dropped)."""
    width = logits.shape[-1]
    return logits[..., : max(0, min(width, vocab - first_column(width)))]


def _tp_sum(x: torch.Tensor, partial_grads: bool = False) -> torch.Tensor:
    """``x`` summed over the tp group. Backward: the identity when every rank's gradient of
    the sum is already whole (the loss is computed from it alike on every rank); summed too
    when each rank's is a part (``partial_grads``: the softmax normaliser, whose gradient comes
    from this rank's columns only)."""
    if _tp() == 1:
        return x
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    if partial_grads:
        x = copy_to_tensor_model_parallel_region(x)  # backward: all-reduce
    return reduce_from_tensor_model_parallel_region(x)


def vocab_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary split across the tp ranks (this rank's columns)."""
    x = logits.float()
    top = x.detach().max(dim=-1, keepdim=True).values
    if _tp() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = x - top
    normaliser = _tp_sum(shifted.exp().sum(dim=-1, keepdim=True), partial_grads=True)
    return shifted - normaliser.log()


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token generalized JSD [b, s] from this rank's columns of both logits (GKD's
    ``generalized_jsd_loss`` before its reduction)."""
    s, t = vocab_log_softmax(student), vocab_log_softmax(teacher).detach()
    if beta == 0:
        terms = t.exp() * (t - s)
    elif beta == 1:
        terms = s.exp() * (s - t)
    else:
        mix = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
        terms = beta * t.exp() * (t - mix) + (1 - beta) * s.exp() * (s - mix)
    return _tp_sum(terms.sum(dim=-1))


@dataclass(frozen=True)
class GkdLoss:
    """``loss_fn(student logits [b, s, V/tp], batch, counts)``: the share of the token-mean
    JSD over the global batch's completion tokens; ``batch[TEACHER]``: the teacher's."""

    beta: float = 0.5
    vocab: int = 0  # real tokens (the padded columns are left out)
    wants_logits = True

    def __call__(self, logits: torch.Tensor, batch: dict[str, torch.Tensor],
                 counts: StepCounts):
        student = _real_columns(logits, self.vocab)
        teacher = _real_columns(batch[TEACHER].to(logits.device), self.vocab)
        jsd = generalized_jsd(student, teacher, self.beta)
        mask = batch["loss_mask"].to(jsd.dtype)
        return (jsd * mask).sum() / max(counts.loss_tokens, 1.0)


def collect_logits(logits: torch.Tensor, batch: dict[str, torch.Tensor], counts=None):
    """The teacher's forward-only loss function: no loss, its logits (this rank's part)."""
    return logits.sum() * 0.0, {"logits": logits.detach()}


collect_logits.wants_logits = True  # type: ignore[attr-defined]


class DistillObjective(Objective):
    """One row per sample; each step's micro-batches get the teacher's logits first."""

    def __init__(self, loss_fn: GkdLoss, teacher: ModelReference, on_policy: Any = None):
        self.loss_fn, self.teacher, self.on_policy = loss_fn, teacher, on_policy

    def batches(self, split_name: str, split: Any, index_lists: Sequence[np.ndarray],
                ) -> Iterator[dict[str, Any]]:
        batches = [split.batch(i) for i in index_lists]
        if self.on_policy is not None and split_name == "train":  # ``onpolicy``: lmbda > 0
            self.on_policy.apply(batches)
        for batch, out in zip(batches, self.teacher.run(batches, collect_logits), strict=False):
            batch[TEACHER] = out["logits"]
        return iter(batches)

    def close(self) -> None:
        self.teacher.close()
