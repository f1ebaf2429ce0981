"""On-policy distillation (``distill.lmbda > 0``: TRL GKD's on-policy share): at each training
step, with probability ``lmbda`` (one draw per step, the same on every rank), every row's
completion is replaced by one the student samples from the row's prompt on the training ranks
(``distill.temperature``, up to ``distill.max_new_tokens``, top-k and top-p off, as GKD's
generation config), cut after its end-of-sequence token; the loss then covers the sampled
tokens. The prompt of a row is its tokens up to the first one whose label is a completion
token."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch


class OnPolicy:
    def __init__(self, sampler: Any, sampling: Any, lmbda: float, seed: int, seq_len: int,
                 pad_id: int):
        self.sampler, self.sampling, self.lmbda, self.seed = sampler, sampling, lmbda, seed
        self.seq_len, self.pad_id = seq_len, pad_id
        self.step = 0
        self.sampled_steps = 0  # how many steps trained on sampled completions (tests, logs)

    def apply(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """Replace the completions of this step's micro-batches (in place), or not."""
        self.step += 1
        if random.Random(f"{self.seed}:{self.step}").random() > self.lmbda:
            return
        rows = [(b, k) for b in batches for k in range(b["tokens"].shape[0])
                if b["loss_mask"][k].sum() > 0]
        if not rows:
            return
        prompts = [_prompt(b, k) for b, k in rows]
        room = self.seq_len + 1 - max(len(p) for p in prompts)
        if room < 1:
            return  # a prompt fills the row: nothing to sample (the dataset's completions stay)
        sampling = dataclasses.replace(self.sampling, seed=self.seed * 7919 + self.step,
                                       max_new_tokens=min(self.sampling.max_new_tokens, room))
        done = self.sampler.sample(prompts, sampling)
        for (b, k), prompt, c in zip(rows, prompts, done, strict=True):
            _rewrite(b, k, prompt, c.completion_ids, self.pad_id)
        for b in batches:
            b.pop("position_ids", None)  # one example a row: positions from 0
        self.sampled_steps += 1


def _prompt(batch: dict[str, torch.Tensor], k: int) -> list[int]:
    first = int(torch.nonzero(batch["loss_mask"][k])[0])
    return batch["tokens"][k, :first + 1].tolist()


def _rewrite(batch: dict[str, torch.Tensor], k: int, prompt: list[int], completion: list[int],
             pad_id: int) -> None:
    ids = torch.tensor([*prompt, *completion], dtype=batch["tokens"].dtype)
    n = len(ids) - 1
    for key, fill in (("tokens", pad_id), ("labels", 0)):
        batch[key][k] = fill
    batch["tokens"][k, :n], batch["labels"][k, :n] = ids[:-1], ids[1:]
    batch["loss_mask"][k] = 0
    batch["loss_mask"][k, len(prompt) - 1:n] = 1
