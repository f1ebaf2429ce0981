"""Model adapters: family declarations (torch-free) and the adapter bound to one HF config.

Torch-free names are imported eagerly; the torch-needing ones (``adapter_for``, ``Adapter``, the
live loader) resolve on first access through ``__getattr__``, so ``mdtk estimate`` and
``ds-config`` stay free of torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

from toolkit.adapters.hfconfig import HFConfig, HFConfigError, read_hf_config

_LAZY = {name: "toolkit.adapters.adapter" for name in (
    "Adapter", "CheckpointMismatch", "Dims", "Family", "UnsupportedModel", "activation",
    "adapter_for", "load_hf_config", "gelu_tanh", "ACTIVATIONS")}

__all__ = ["HFConfig", "HFConfigError", "read_hf_config", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
