"""Rewards and advantages of a generation batch, as TRL's GRPOTrainer computes them (float32,
its ``sum_then_normalize`` aggregation): the weighted sum of the reward functions (a completion
every function left unscored is NaN, excluded from its group's baseline, its advantage 0),
minus its group's mean, divided by ``std + 1e-4`` (the group's, the batch's, or not at all:
``scale_rewards``), std with Bessel's correction. The batch's metrics with TRL's names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from toolkit.errors import UserError


class RewardError(UserError):
    """A reward function that fails or returns the wrong shape."""


@dataclass(frozen=True)
class RewardFn:
    name: str
    fn: Callable[..., Sequence[float | None]]
    weight: float


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's ``nanstd``: NaNs ignored, Bessel's correction (NaN for fewer than 2 values)."""
    keep = dim is not None
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    out = torch.sqrt(var * corr)
    return out if keep else out.reshape(())


def score(fns: Sequence[RewardFn], prompts: list, completions: list, completion_ids: list,
          columns: dict[str, list]) -> torch.Tensor:
    """[N, F] float32 rewards (None -> NaN), each function called once with TRL's arguments."""
    out = torch.zeros(len(prompts), len(fns), dtype=torch.float32)
    for i, f in enumerate(fns):
        try:
            values = list(f.fn(prompts=prompts, completions=completions,
                               completion_ids=completion_ids, **columns))
        except Exception as e:
            raise RewardError(f"reward function {f.name!r} failed: {type(e).__name__}: {e}") \
                from e
        if len(values) != len(prompts):
            raise RewardError(f"reward function {f.name!r} returned {len(values)} rewards for "
                              f"{len(prompts)} completions: return one per completion (None "
                              "for a completion it does not score).")
        try:
            out[:, i] = torch.tensor([float("nan") if v is None else float(v) for v in values])
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward function {f.name!r} returned a non-number ({e}).") from e
    return out


def advantages(per_func: torch.Tensor, weights: Sequence[float], group: int, scale: str,
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages [N] of a generation batch's rewards [N, F], and the batch's reward
    metrics (``reward``, ``reward_std``, ``frac_reward_zero_std``)."""
    w = torch.tensor(list(weights), dtype=torch.float32)
    unscored = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * w.unsqueeze(0)).nansum(dim=1)
    rewards[unscored] = float("nan")
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else \
            torch.zeros_like(rewards)
    else:
        std = nanstd(grouped, dim=1).reshape(-1).repeat_interleave(group) if group > 1 else \
            torch.zeros_like(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    adv = torch.nan_to_num(adv, nan=0.0)
    metrics = {"reward": float(torch.nanmean(rewards)), "reward_std": float(nanstd(rewards)),
               "frac_reward_zero_std": float(zero_std.float().mean())}
    return adv, metrics


def function_metrics(per_func: torch.Tensor, names: Sequence[str]) -> dict[str, float]:
    return {k: v for i, n in enumerate(names)
            for k, v in ((f"rewards/{n}/mean", float(torch.nanmean(per_func[:, i]))),
                         (f"rewards/{n}/std", float(nanstd(per_func[:, i]))))}


def completion_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    n = torch.tensor(list(lengths), dtype=torch.float32)
    return {"completions/mean_length": float(n.mean()), "completions/min_length": float(n.min()),
            "completions/max_length": float(n.max()),
            "completions/clipped_ratio": float(torch.tensor(list(truncated)).float().mean())}


def columns_of(rows: Sequence[Any]) -> dict[str, list]:
    """The prompt rows' other columns as lists (TRL passes every column but the prompt)."""
    keys = sorted({k for r in rows for k in r.columns})
    return {k: [r.columns.get(k) for r in rows] for k in keys}


def probe(fns: Sequence[RewardFn], rows: Sequence[Any]) -> None:
    """Each reward function called once on the first prompt rows with empty completions, so
    one that fails or returns the wrong number of rewards is refused before any model or
    engine is built (TRL finds out at the first generation)."""
    rows = list(rows[:2])
    conversational = isinstance(rows[0].prompt, list)
    completions = [[{"role": "assistant", "content": ""}] if conversational else ""
                   for _ in rows]
    score(fns, [r.prompt for r in rows], completions, [[] for _ in rows], columns_of(rows))
