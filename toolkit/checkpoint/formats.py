"""The one registry of checkpoint formats: how to recognise a folder, and how to open it.

Each format module registers itself when imported: ``register(name, open_fn, looks_like)``.

- ``looks_like(path) -> bool``: a cheap test on the folder's file names (reads no tensors).
- ``open_fn(path, make_adapter) -> Opening(source, adapter, info)`` (``source.Opening``):
  ``source`` is a ``TensorSource`` (``names``, ``shape``, ``dtype``, ``read(name, region)``,
  ``close``); ``adapter`` is the model's adapter, built by ``make_adapter(hf_dir, common)`` from
  the HF config folder the checkpoint carries (``None`` when it carries none) and its run
  metadata; ``info`` is a dict with optional keys ``iteration``, ``layout``, ``files`` and
  ``folder``.

The adapter comes from the caller because adapters are a layer above checkpoints: this package
never imports them. ``MODULES`` lists the modules that register formats; they are imported on
first use (a missing optional one is skipped), in this order, which is also the order detection
tries them in.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.source import ModelAdapter, Opening

#: ``make_adapter(hf_config_dir, common)``: the model's adapter, from its caller.
AdapterFactory = Callable[[Path | None, dict[str, Any]], ModelAdapter]
#: A format's opener: ``open_fn(path, make_adapter)``.
Opener = Callable[[Path, AdapterFactory], Opening]

#: Modules that register a format when imported.
MODULES = ("toolkit.checkpoint.hf", "toolkit.checkpoint.mcore_dist",
           "toolkit.checkpoint.megatron_legacy", "toolkit.checkpoint.deepspeed")


@dataclass(frozen=True)
class Format:
    name: str
    open: Opener
    looks_like: Callable[[Path], bool]


FORMATS: dict[str, Format] = {}
_loaded = False


def register(name: str, open_fn: Opener, looks_like: Callable[[Path], bool]) -> None:
    """Add (or replace) the format ``name``."""
    FORMATS[name] = Format(name, open_fn, looks_like)


def load() -> dict[str, Format]:
    """Every registered format (importing ``MODULES`` the first time), in ``MODULES`` order
    whatever order they were imported in (formats of other modules last)."""
    global _loaded
    if not _loaded:
        for module in MODULES:
            if importlib.util.find_spec(module) is not None:
                importlib.import_module(module)
        _loaded = True

    def rank(fmt: Format) -> int:
        module = fmt.open.__module__
        return MODULES.index(module) if module in MODULES else len(MODULES)

    return dict(sorted(FORMATS.items(), key=lambda item: rank(item[1])))


def get(name: str) -> Format:
    formats = load()
    if name not in formats:
        raise CheckpointError(f"unknown checkpoint format {name!r}; known: {sorted(formats)}.")
    return formats[name]


def detect(path: str | Path) -> str:
    """The format name of ``path``; raises CheckpointError when none or several match."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist.")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file: pass the checkpoint folder.")
    formats = load()
    found = [name for name, fmt in formats.items() if fmt.looks_like(path)]
    if not found:
        raise CheckpointError(f"{path}: not a known checkpoint format (tried "
                              f"{', '.join(formats)}). Pass the folder holding config.json "
                              "(HF), latest_checkpointed_iteration.txt (Megatron) or the "
                              "iteration folder.")
    if len(found) > 1:
        raise CheckpointError(f"{path} looks like several formats ({', '.join(found)}): pass "
                              "--from to choose.")
    return found[0]
