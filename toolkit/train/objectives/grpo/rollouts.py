"""Where a generation batch's completions come from: recorded (``grpo.rollouts``: the file's
groups in order, wrapping at its end) or generated on the training ranks (``Generated``: the
generation engine on the live policy chunks, each data-parallel rank sampling its own rows of
the batch; rewards scored where the completions are, then summed over data parallelism so every
rank holds the whole batch's rewards for the group baselines)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from toolkit.train.data.grpo import PromptRow, RecordedGroup
from toolkit.train.loop.loss import data_parallel_sums
from toolkit.train.objectives.grpo import rewards as rw
from toolkit.train.objectives.grpo.spec import RECORDED


@dataclass
class Rollout:
    """One generation batch (N completion rows; ``completion_ids`` / ``sampling_logps`` of the
    rows this rank trains on, None for the others)."""

    prompts: list[PromptRow]
    completion_ids: list[tuple[int, ...] | None]
    per_func: torch.Tensor  # [N, F] rewards
    lengths: list[int]
    truncated: list[bool]
    sampling_logps: list[list[float] | None] | None = None


class Recorded:
    """Generation batch ``g`` = groups ``[gP, (g+1)P)`` of the file (wrapping)."""

    names = [RECORDED]

    def __init__(self, groups: Sequence[RecordedGroup], ends: set[int]):
        self.groups, self.ends = list(groups), ends

    def weights(self) -> list[float]:
        return [1.0]

    def close(self) -> None:
        pass

    def batch(self, gen: int, prompts_per_batch: int, mine: np.ndarray) -> Rollout:
        picked = [self.groups[(gen * prompts_per_batch + i) % len(self.groups)]
                  for i in range(prompts_per_batch)]
        prompts = [g.prompt for g in picked for _ in g.completion_ids]
        ids = [c for g in picked for c in g.completion_ids]
        per_func = torch.tensor([r for g in picked for r in g.rewards],
                                dtype=torch.float32).unsqueeze(1)
        logps = ([list(lp) for g in picked for lp in g.logprobs]
                 if picked[0].logprobs is not None else None)
        return Rollout(prompts, list(ids), per_func, [len(c) for c in ids],
                       [c[-1] not in self.ends for c in ids], logps)


class Generated:
    """Completions sampled on the training ranks by ``sampler`` (``sampling.LiveSampler``: the
    generation engine on the live chunks), scored by the reward functions."""

    def __init__(self, prompts: Sequence[PromptRow], group: int, fns: Sequence[rw.RewardFn],
                 sampler: Any, sampling: Any, tokenizer: Any, *, shuffle: bool, seed: int,
                 every_row: bool = False):
        self.every_row = every_row  # expert parallelism: every rank samples the whole batch
        self.prompts, self.group, self.fns = list(prompts), group, list(fns)
        self.sampler, self.sampling, self.tokenizer = sampler, sampling, tokenizer
        self.shuffle, self.seed = shuffle, seed
        self.names = [f.name for f in self.fns]

    def weights(self) -> list[float]:
        return [f.weight for f in self.fns]

    def close(self) -> None:
        close = getattr(self.sampler, "close", None)  # a vLLM engine's groups and memory
        if close is not None:
            close()

    def _prompt(self, position: int) -> PromptRow:
        n = len(self.prompts)
        epoch, at = divmod(position, n)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle \
            else np.arange(n)
        return self.prompts[int(order[at])]

    def batch(self, gen: int, prompts_per_batch: int, mine: np.ndarray) -> Rollout:
        import dataclasses

        prompts = [self._prompt(gen * prompts_per_batch + i)
                   for i in range(prompts_per_batch) for _ in range(self.group)]
        rows = [int(i) for i in mine]
        # the experts' all-to-all runs over data-parallel ranks: they must run the same forwards
        sampled = list(range(len(prompts))) if self.every_row else rows
        sampling = dataclasses.replace(self.sampling, seed=self.seed * 7919 + gen * 104729
                                       + sampled[0])
        out = self.sampler.sample([list(prompts[i].ids) for i in sampled], sampling,
                                  logprobs=True)
        done = [out[sampled.index(i)] for i in rows] if self.every_row else out
        ids: list[tuple[int, ...] | None] = [None] * len(prompts)
        logps: list[list[float] | None] = [None] * len(prompts)
        for i, c in zip(rows, done, strict=True):
            ids[i], logps[i] = tuple(c.completion_ids), c.logprobs
        mine_prompts = [prompts[i] for i in rows]
        texts = self.tokenizer.batch_decode([list(ids[i]) for i in rows],
                                            skip_special_tokens=True)
        if isinstance(mine_prompts[0].prompt, list):
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        scored = rw.score(self.fns, [p.prompt for p in mine_prompts], texts,
                          [list(ids[i]) for i in rows], rw.columns_of(mine_prompts))
        table = torch.zeros(len(prompts), len(self.fns) + 2, dtype=torch.float64)
        table[rows, :len(self.fns)] = scored.double()
        table[rows, -2] = torch.tensor([float(len(ids[i])) for i in rows], dtype=torch.float64)
        table[rows, -1] = torch.tensor([float(c.finish_reason == "length") for c in done],
                                       dtype=torch.float64)
        table = torch.tensor(data_parallel_sums(table.reshape(-1).tolist()),
                             dtype=torch.float64).view(len(prompts), -1)
        return Rollout(prompts, ids, table[:, :-2].float(), [int(x) for x in table[:, -2]],
                       [bool(x) for x in table[:, -1]], logps)
