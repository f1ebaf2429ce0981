"""Model adapters: family declarations (torch-free) and the adapter bound to one HF config.

- ``family``: ``Family`` base, ``Dims`` (the one model description), ``Moe`` switches;
- ``registry``: architecture -> family (``@register``; discovers ``model_adapters``);
- ``hfconfig``: ``HFConfig`` and the config translations families share;
- ``presets``: published configs of well-known checkpoints;
- ``shape``: ``ModelShape`` (the model's tensors, as the memory model counts them);
- ``spec``: ``ModelSpec`` (one model description per command) and the only reader and writer
  of ``config.json`` (``read_hf_config``, ``write_config``);
- ``adapter`` (torch): ``Adapter`` (the mapping; ``spec.adapter`` / ``adapter_for`` build it);
- ``live`` (torch, megatron-core): load an HF checkpoint into live chunks and export them.
- ``stream`` (torch): the live chunks' weights as buckets of HF-named tensors (rollout
  engines); ``live.export_hf`` writes that stream.

Torch-free names are imported eagerly; the torch-needing ones resolve on first access through
``__getattr__``, so ``mdtk estimate`` and ``ds-config`` import neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

from toolkit.adapters.family import ConfigKeyError, Dims, Family, Moe
from toolkit.adapters.hfconfig import HFConfig, HFConfigError, UnsupportedModel
from toolkit.adapters.registry import FAMILIES, family_for, family_of, register, supported
from toolkit.adapters.spec import ModelSpec, adapter_for, load_hf_config, read_hf_config

_LAZY = {
    **dict.fromkeys(("ACTIVATIONS", "Adapter", "CheckpointMismatch", "activation"),
                    "toolkit.adapters.adapter"),
    **dict.fromkeys(("build_model", "current_coord", "export_hf", "fill_chunks",
                     "forward_logits", "load_hf"), "toolkit.adapters.live"),
    **dict.fromkeys(("StreamError", "hf_buckets", "hf_tensors"), "toolkit.adapters.stream"),
}

__all__ = ["FAMILIES", "ConfigKeyError", "Dims", "Family", "HFConfig", "HFConfigError",
           "ModelSpec", "Moe", "UnsupportedModel", "adapter_for", "family_for", "family_of",
           "load_hf_config", "read_hf_config", "register", "supported", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
