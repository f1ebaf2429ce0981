"""LR schedule: a pure function of the step, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from toolkit.train.loop.schedule import LRSchedule, lr_at

KW = dict(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)


def test_warmup_is_linear_from_first_step():
    for step, want in [(0, 0.25), (1, 0.5), (2, 0.75), (3, 1.0)]:
        for decay in ("cosine", "linear", "constant"):
            assert lr_at(step, decay=decay, **KW) == pytest.approx(want, abs=1e-15)


def test_cosine_hand_values():
    # progress = (step + 1 - 4) / 10
    assert lr_at(4, decay="cosine", **KW) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(0.1 * math.pi)), abs=1e-15)  # 0.977975...
    assert lr_at(4, decay="cosine", **KW) == pytest.approx(0.9779754323328191, abs=1e-15)
    assert lr_at(8, decay="cosine", **KW) == pytest.approx(0.55, abs=1e-15)  # halfway
    assert lr_at(13, decay="cosine", **KW) == pytest.approx(0.1, abs=1e-15)  # last step
    assert lr_at(50, decay="cosine", **KW) == pytest.approx(0.1, abs=1e-15)  # past the end


def test_linear_and_constant_hand_values():
    assert lr_at(4, decay="linear", **KW) == pytest.approx(0.91, abs=1e-15)
    assert lr_at(8, decay="linear", **KW) == pytest.approx(0.55, abs=1e-15)
    assert lr_at(13, decay="linear", **KW) == pytest.approx(0.1, abs=1e-15)
    assert lr_at(9, decay="constant", **KW) == 1.0


def test_no_warmup_and_bad_input():
    assert lr_at(0, lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=4,
                 decay="linear") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="decay='step'"):
        lr_at(0, decay="step", **KW)
    with pytest.raises(ValueError, match="step=-1"):
        lr_at(-1, decay="cosine", **KW)


def test_schedule_is_monotone_in_bounds_and_applies_to_optimizer():
    sched = LRSchedule(lr=3e-3, min_lr=3e-4, warmup_steps=10, total_steps=100)
    values = [sched(s) for s in range(100)]
    assert all(a <= b for a, b in zip(values[:9], values[1:10], strict=True))
    assert all(a >= b for a, b in zip(values[9:-1], values[10:], strict=True))
    assert min(values) == pytest.approx(3e-4) and max(values) == pytest.approx(3e-3)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    assert sched.apply(opt, 42) == values[42] == opt.param_groups[0]["lr"]
