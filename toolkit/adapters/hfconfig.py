"""HF ``config.json`` without transformers: an attribute view and the translation helpers.

``HFConfig`` reads like a transformers config (``cfg.hidden_size``, ``getattr(cfg, "head_dim",
None)``) but is a plain view over the JSON dict, so reading a checkpoint's config costs no torch or
transformers import (``mdtk estimate``, ``ds-config``, ``inspect``). Families read both this view
and real transformers configs through the same attribute access.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


class HFConfigError(ValueError):
    """A config.json that cannot be read (missing, not JSON, not an object); names the path."""


class HFConfig:
    """Read-only attribute view over an HF ``config.json`` dict.

    Missing keys raise AttributeError, so ``getattr(cfg, key, default)`` and ``hasattr`` behave as
    on transformers configs. Sub-configs (keys ending in ``_config``, e.g. ``text_config``) come
    back as HFConfig views; other nested objects (``rope_scaling``) stay dicts, as in transformers.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        if not isinstance(data, Mapping):
            raise HFConfigError(f"an HF config is a JSON object, got {type(data).__name__}.")
        object.__setattr__(self, "_data", dict(data))

    def __getattr__(self, name: str) -> Any:
        data = object.__getattribute__(self, "_data")
        if name not in data:
            raise AttributeError(f"HF config has no {name!r}")
        value = data[name]
        if name.endswith("_config") and isinstance(value, Mapping):
            return HFConfig(value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("HFConfig is read-only; build a new one from to_dict().")

    def __contains__(self, name: object) -> bool:
        return name in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFConfig) and self._data == other._data

    def __hash__(self) -> int:
        return hash(json.dumps(self._data, sort_keys=True, default=str))

    def __repr__(self) -> str:
        return f"HFConfig({self._data!r})"

    def get(self, name: str, default: Any = None) -> Any:
        """The value of ``name`` when present and not null, else ``default``."""
        value = self._data.get(name)
        return default if value is None else value

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the underlying JSON dict."""
        return copy.deepcopy(self._data)


def read_hf_config(folder_or_file: str | Path) -> HFConfig:
    """The ``config.json`` of an HF folder (or the file itself), parsed as plain JSON."""
    path = Path(folder_or_file)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no config.json" if path.is_dir() else f"{path} does not exist"
        raise HFConfigError(f"{where}: pass an HF model folder or its config.json.")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConfigError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise HFConfigError(f"{file} holds a JSON {type(data).__name__}, not an object.")
    return HFConfig(data)
