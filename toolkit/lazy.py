"""``torch`` as a module proxy: imported on the first attribute use, not at import.

Why: ``import torch`` takes 1.3 s on a 2-core machine, longer than copying a 1B model's 2.3 GiB
(0.7 s). Modules on a path that may never touch a tensor (a conversion that only copies bytes
file to file, ``mdtk inspect``) write ``from toolkit.lazy import torch`` and use ``torch.x`` as
usual: the first ``torch.x`` imports torch, later ones are a dict lookup. Annotations such as
``torch.Tensor`` cost nothing under ``from __future__ import annotations``.

This module imports only the standard library (layer 1 of docs/architecture.md), so any
package may use it.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """``proxy.x`` imports the module on the first attribute use (then it is a dict lookup)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


torch: Any = LazyModule("torch")
