"""The DPO loss family: one per-pair formula per TRL ``loss_type`` name (TRL 1.16's
``DPOTrainer._compute_loss``), averaged over pairs by the caller. Only losses whose value for a
pair depends on that pair alone are offered, so the loss of a global batch is the same however
it is split into micro-batches and data-parallel ranks (TRL's ``aot``/``aot_unpaired`` sort over
the batch and ``sft`` averages tokens over it: left out)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.train.objectives.dpo import spec


@dataclass(frozen=True)
class Pairs:
    """Per-pair inputs of a loss: policy and reference log-probabilities of the chosen and
    rejected completions (summed over their tokens) and the completions' token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    @property
    def chosen_ratio(self) -> torch.Tensor:
        return self.chosen - self.ref_chosen

    @property
    def rejected_ratio(self) -> torch.Tensor:
        return self.rejected - self.ref_rejected


Loss = Callable[[Pairs, float, float], torch.Tensor]  # (pairs, beta, label_smoothing) -> [pairs]


def _sigmoid(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    return -F.logsigmoid(beta * (p.chosen_ratio - p.rejected_ratio))


def _hinge(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    return torch.relu(1 - beta * (p.chosen_ratio - p.rejected_ratio))


def _per_token_delta(p: Pairs) -> torch.Tensor:
    return (p.chosen_ratio / p.chosen_tokens.clamp(min=1.0)
            - p.rejected_ratio / p.rejected_tokens.clamp(min=1.0))


def _ipo(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    return (_per_token_delta(p) - 1 / (2 * beta)) ** 2


def _sigmoid_norm(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    return -F.logsigmoid(beta * _per_token_delta(p))


def _robust(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    z = beta * (p.chosen_ratio - p.rejected_ratio)
    return (-(1 - ls) * F.logsigmoid(z) + ls * F.logsigmoid(-z)) / (1 - 2 * ls)


def _exo_pair(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    z = beta * (p.chosen_ratio - p.rejected_ratio)
    return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-ls))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(ls)))


def _bco_pair(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    return -F.logsigmoid(beta * p.chosen_ratio) - F.logsigmoid(-beta * p.rejected_ratio)


def _nca_pair(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    c, r = beta * p.chosen_ratio, beta * p.rejected_ratio
    return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)


def _sppo_hard(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    return (p.chosen_ratio - 0.5 / beta) ** 2 + (p.rejected_ratio + 0.5 / beta) ** 2


def _apo_zero(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    return 1 - torch.sigmoid(beta * p.chosen_ratio) + torch.sigmoid(beta * p.rejected_ratio)


def _apo_down(p: Pairs, beta: float, ls: float) -> torch.Tensor:
    return (torch.sigmoid(beta * p.chosen_ratio)
            + 1 - torch.sigmoid(beta * (p.chosen_ratio - p.rejected_ratio)))


#: TRL's names (``spec.LOSSES``, which the config schema offers)
LOSSES: dict[str, Loss] = {
    "sigmoid": _sigmoid, "hinge": _hinge, "ipo": _ipo, "sigmoid_norm": _sigmoid_norm,
    "robust": _robust, "exo_pair": _exo_pair, "bco_pair": _bco_pair, "nca_pair": _nca_pair,
    "sppo_hard": _sppo_hard, "apo_zero": _apo_zero, "apo_down": _apo_down,
}
assert tuple(LOSSES) == spec.LOSSES, "spec.LOSSES names the table's losses"
