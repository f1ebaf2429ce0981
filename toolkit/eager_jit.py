"""megatron-core's ``jit_fuser`` without torch.compile in CPU mode, from the first import.

megatron-core 0.16 sets ``jit_fuser = torch.compile`` when ``megatron.core.jit`` is imported,
and its fusion modules decorate helpers with it at import time: each call of torch.compile
imports torch._dynamo and torch._inductor (~1.2 CPU-s of every process that imports
megatron-core, measured with ``-X importtime``), although CPU mode runs them eagerly anyway
(``runtime._eager_on_cpu``: ``TORCH_COMPILE_DISABLE``). In CPU mode ``megatron.core.jit`` is
executed with ``torch.compile`` standing for a no-op decorator, so ``jit_fuser`` is a no-op;
torch.compile itself is left as it was for everything else."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

TARGET = "megatron.core.jit"


def _eager() -> bool:
    """CPU mode as ``runtime.use_cuda`` decides it (no CUDA, or ``MDTK_DEVICE=cpu``), unless
    the user keeps torch.compile on (``TORCH_COMPILE_DISABLE=0``)."""
    flag = os.environ.get("TORCH_COMPILE_DISABLE", "").lower()
    if flag in ("0", "false"):
        return False
    if flag in ("1", "true") or os.environ.get("MDTK_DEVICE", "").lower() == "cpu":
        return True
    import torch  # megatron.core imports it before its jit module

    return not torch.cuda.is_available()


def _no_compile(model: Any = None, **kwargs: Any) -> Any:
    return model if model is not None else (lambda fn: fn)


class _Loader(importlib.abc.Loader):
    def __init__(self, real: Any):
        self.real = real

    def create_module(self, spec: Any) -> Any:
        return self.real.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import torch

        compile_ = torch.compile
        torch.compile = _no_compile
        try:
            self.real.exec_module(module)
        finally:
            torch.compile = compile_


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET or not _eager():
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Once per process, before megatron-core is imported (toolkit's package import)."""
    if TARGET not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
