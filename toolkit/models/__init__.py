"""The project's megatron-core building blocks: layer spec, CPU-safe config, model chunks.

The names are loaded on first use, so that a light module of this package (``kernels``: the
run's kernel choice, read by the config checks) does not import megatron-core."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"block_spec": "build", "build_chunks": "build", "layer_spec": "build",
            "transformer_config": "build", "TorchNorm": "norm"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"toolkit.models.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'toolkit.models' has no attribute {name!r}")
