"""GRPO in the trainer: each optimizer step's micro-batches from its generation batch.

The sampler's indices name completion slots (``data.grpo``: ``index // global_batch`` is the
step, ``index % global_batch`` the row), so this rank's rows are the same at every step. Step
``s`` trains on generation batch ``s // num_iterations``; when it starts: the rollout (recorded,
or generated and scored), the advantages, the reference's per-token log-probabilities (``beta
!= 0``) and, when the batch serves several steps, the policy's before its first update (the
ratio's denominator; TRL's ``old_per_token_logps``; also for TRL's correction of the sampler's
mismatch, whose ratio is computed then: ``loss.sampling_ratio``). A row is prompt + completion,
padded; the loss mask covers the completion's tokens (not a truncated one's with
``mask_truncated_completions``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from toolkit.train.loop.engine import forward_outputs
from toolkit.train.objectives.base import Objective
from toolkit.train.objectives.grpo import rewards as rw
from toolkit.train.objectives.grpo.loss import GrpoLoss, sampling_ratio, token_logps
from toolkit.train.objectives.grpo.rollouts import Rollout
from toolkit.train.objectives.grpo.spec import EXTREMES


@dataclass(frozen=True)
class TokenLogps:
    """A forward-only loss function: no loss, the rows' per-token log-probabilities [b, s]."""

    vocab: int
    temperature: float
    wants_logits = True

    def __call__(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], counts=None):
        logp, _ = token_logps(logits, batch["labels"], self.vocab, self.temperature)
        return logits.sum() * 0.0, {"logps": logp.detach().float().cpu()}


@dataclass(frozen=True)
class Rows:
    """How completion rows become micro-batches."""

    seq_len: int
    pad_id: int
    mask_truncated: bool


def micro_batch(rollout: Rollout, rows: Sequence[int], adv: torch.Tensor,
                metrics: torch.Tensor, layout: Rows) -> dict[str, torch.Tensor]:
    """The tensors of ``rows`` of ``rollout``: tokens, labels and loss mask [b, seq_len] (the
    label of position t is token t + 1), advantages [b], the engine's log-probabilities of the
    completion tokens where it reported them, the batch's metrics on every row."""
    b, s = len(rows), layout.seq_len
    tokens = torch.full((b, s), layout.pad_id, dtype=torch.long)
    labels = torch.zeros((b, s), dtype=torch.long)
    mask = torch.zeros((b, s), dtype=torch.float32)
    sampled = torch.zeros((b, s), dtype=torch.float32)
    for k, r in enumerate(rows):
        prompt, completion = rollout.prompts[r].ids, rollout.completion_ids[r]
        ids = torch.tensor([*prompt, *completion], dtype=torch.long)
        n = len(ids) - 1
        tokens[k, :n], labels[k, :n] = ids[:-1], ids[1:]
        start = len(prompt) - 1  # the position whose label is the first completion token
        if not (layout.mask_truncated and rollout.truncated[r]):
            mask[k, start:n] = 1.0
        logps = rollout.sampling_logps[r] if rollout.sampling_logps else None
        if logps is not None:
            sampled[k, start:start + len(logps)] = torch.tensor(logps[:n - start])
    out = {"tokens": tokens, "labels": labels, "loss_mask": mask,
           "advantages": adv[list(rows)].float(), "batch_metrics": metrics.repeat(b, 1)}
    if rollout.sampling_logps:
        out["sampling_logps"] = sampled
    return out


class GrpoObjective(Objective):
    shown_metrics = ("reward",)

    def __init__(self, loss_fn: GrpoLoss, source: Any, *, global_batch: int, group: int,
                 num_iterations: int, scale_rewards: str, rows: Rows,
                 policy: Sequence[torch.nn.Module], reference: Any = None,
                 correction: tuple[str, float | None, float | None] | None = None):
        self.loss_fn, self.source, self.rows = loss_fn, source, rows
        self.correction = correction  # (mode, clip_min, clip_max): loss.sampling_ratio
        self.global_batch, self.group, self.num_iterations = global_batch, group, num_iterations
        self.scale_rewards, self.policy, self.reference = scale_rewards, list(policy), reference
        self._gen: int | None = None
        self._batches: list[dict[str, torch.Tensor]] = []

    def batches(self, split_name: str, split: Any, index_lists: Sequence[np.ndarray],
                ) -> Iterator[dict[str, Any]]:
        step = int(index_lists[0][0]) // self.global_batch
        gen = step // self.num_iterations
        if gen != self._gen:
            self._batches = self._prepare(gen, [np.asarray(i) % self.global_batch
                                                for i in index_lists])
            self._gen = gen
        return iter([dict(b) for b in self._batches])

    def _prepare(self, gen: int, lists: list[np.ndarray]) -> list[dict[str, torch.Tensor]]:
        mine = np.concatenate(lists)
        rollout = self.source.batch(gen, self.global_batch // self.group, mine)
        adv, metrics = rw.advantages(rollout.per_func, self.source.weights(), self.group,
                                     self.scale_rewards)
        metrics.update(rw.completion_metrics(rollout.lengths, rollout.truncated))
        metrics.update(rw.function_metrics(rollout.per_func, self.source.names))
        if self.correction:
            metrics.update(dict.fromkeys(EXTREMES, 0.0))  # set once the old log-probs are known
        values = torch.tensor([metrics[n] for n in self.loss_fn.batch_names],
                              dtype=torch.float32)
        batches = [micro_batch(rollout, [int(r) for r in rows], adv, values, self.rows)
                   for rows in lists]
        collect = TokenLogps(self.loss_fn.vocab, self.loss_fn.temperature)
        if self.reference is not None:
            for b, out in zip(batches, self.reference.run(batches, collect), strict=False):
                b["ref_logps"] = out["logps"]
        if self.num_iterations > 1 or self.correction:
            out = forward_outputs(self.policy, iter(batches), collect,
                                  num_microbatches=len(batches),
                                  micro_batch=int(batches[0]["tokens"].shape[0]),
                                  seq_len=self.rows.seq_len)
            for b, o in zip(batches, out, strict=False):
                b["old_logps"] = o["logps"]
                if self.correction:
                    b["is_ratio"] = sampling_ratio(o["logps"], b["sampling_logps"],
                                                   b["loss_mask"], *self.correction)
        if self.correction:
            self._extremes(batches)
        return batches

    def _extremes(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """TRL's max |gap| and max / min ratio over the generation batch (token modes: over
        the completion tokens; sequence modes: over the rows), the data-parallel ranks' rows
        included (one all-reduce), written into every micro-batch's ``batch_metrics``."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from toolkit import runtime

        local = torch.full((3,), -torch.inf, dtype=torch.float64, device=runtime.device())
        for b in batches:
            if "is_ratio" not in b:  # not the last pipeline stage: no log-probs here
                continue
            mask = b["loss_mask"].bool()
            ratio = b["is_ratio"]
            ratio = ratio.flatten() if ratio.shape[-1] == 1 else ratio[mask]
            gap = (b["old_logps"] - b["sampling_logps"]).abs()[mask]
            for i, x in enumerate((gap, ratio, -ratio)):
                if x.numel():
                    local[i] = torch.maximum(local[i], x.max().double().to(local.device))
        dist.all_reduce(local, op=dist.ReduceOp.MAX,
                        group=ps.get_data_parallel_group(with_context_parallel=True))
        found = local.tolist()
        values = [sign * v if v > -float("inf") else 0.0  # TRL: 0 when nothing is counted
                  for sign, v in zip((1.0, 1.0, -1.0), found, strict=True)]
        names = list(self.loss_fn.batch_names)
        for b in batches:
            for name, v in zip(EXTREMES, values, strict=True):
                b["batch_metrics"][:, names.index(name)] = float(v)

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()
        self.source.close()
