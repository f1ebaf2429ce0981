"""What a LoRA / DoRA run adapts (torch-free: the memory model and the planner count it too)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from toolkit.errors import UserError


class LoraError(UserError):
    """A LoRA setting or adapter that cannot work with this model; the message says the fix."""


METHODS = ("lora", "dora")


@dataclass(frozen=True)
class LoraSpec:
    method: str = "lora"
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: frozenset[str] = frozenset()  # HF projection names (q_proj, ...)
    rslora: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise LoraError(f"peft.method={self.method!r}: choose lora or dora (or none).")
        if self.r <= 0:
            raise LoraError(f"peft.r={self.r}: the adapter rank must be a positive integer.")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"peft.dropout={self.dropout}: must be in [0, 1).")

    @property
    def dora(self) -> bool:
        return self.method == "dora"

    def with_targets(self, targets: Iterable[str]) -> LoraSpec:
        from dataclasses import replace

        return replace(self, targets=frozenset(targets))
