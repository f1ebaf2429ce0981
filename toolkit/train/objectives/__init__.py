"""What a run optimises: a data mode's micro-batches and loss. ``base.Objective`` is
pretraining's and SFT's; ``dpo`` is preference tuning. A new objective is a module here."""

from toolkit.train.objectives.base import Objective

__all__ = ["Objective"]
