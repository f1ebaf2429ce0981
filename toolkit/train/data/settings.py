"""What changes the tokenised samples: ``DataSettings`` (read from the config's data and train
sections, field by field), and ``DataError``, the error of every data module."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from toolkit.errors import UserError

#: Settings read from the train section; every other one is the data section's key of the same
#: name, except these (renamed: the settings' names enter the cache key and stay as they are).
TRAIN_KEYS = ("seq_len", "seed")
SECTION_KEYS = {"sft_format": "format"}


class DataError(UserError):
    """Data that cannot be used; the message names the source, the row or the setting."""


@dataclass(frozen=True)
class DataSettings:
    """Everything that changes the tokenised samples (and so the cache key)."""

    mode: str
    sources: tuple[str, ...]
    seq_len: int
    seed: int = 1234
    validation_sources: tuple[str, ...] = ()
    validation_split: float = 0.0
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    template: str = "auto"
    pack: bool = False
    sft_format: str = "auto"  # data.format: auto (per row) or one of SFT_FORMATS
    conversations_field: str = "conversations"
    weights: tuple[float, ...] = ()  # pretrain: blend weights, one per source (none: by size)

    @classmethod
    def from_config(cls, cfg: Any) -> DataSettings:
        """From a ``config.TrainConfig``: each setting from the section that holds it (lists
        become tuples), so a new setting is a field here and a key of the same name there."""
        values = {}
        for f in dataclasses.fields(cls):
            section = cfg.train if f.name in TRAIN_KEYS else cfg.data
            value = getattr(section, SECTION_KEYS.get(f.name, f.name))
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)
