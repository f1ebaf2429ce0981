"""The trainer's config from YAML, a mapping or overrides: the schema (``schema``) built by the
typed engine (``typed``), ``bundled:`` names resolved, the cross-key checks run (``checks``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from toolkit.train.config import typed
from toolkit.train.config.checks import validate
from toolkit.train.config.schema import TrainConfig


def config_from_dict(raw: Mapping[str, Any]) -> TrainConfig:
    """Build and validate a config from a YAML-loaded mapping (``bundled:`` names resolved)."""
    cfg = typed.build(TrainConfig, raw, "")
    typed.resolve_bundled(cfg)
    validate(cfg)
    return cfg


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` -> (["optim", "lr"], value typed by the schema)."""
    return typed.parse_override(TrainConfig, text)


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``key.path=value`` applied (later ones win)."""
    return typed.apply_overrides(TrainConfig, raw, overrides)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML file (a path or a ``bundled:`` name; defaults when ``path`` is None), apply
    the overrides, validate. Raises ConfigError naming the offending key."""
    raw = typed.read_yaml(path) if path is not None else {}
    return config_from_dict(apply_overrides(raw, overrides))
