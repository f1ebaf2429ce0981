"""Let a finished ZeRO-3 engine be freed (DeepSpeed 0.19 keeps it alive after ``destroy()``).

Three references outlive ``DeepSpeedEngine.destroy()`` and hold the whole engine (model,
optimizer, partitioned parameters and the process groups they use) for the life of the process:

- ``parameter_offload.FWD_MODULE_STACK``, a module-level list, keeps every ZeRO-3 root module
  ever set up (pushed at set-up, never popped);
- the ``lru_cache`` on ``PartitionedParameterCoordinator.__params_to_release`` is keyed by the
  coordinator and its modules;
- each module's ``pre_bwd_fn`` / ``post_bwd_fn`` autograd Function classes close over the
  module and the ZeRO-3 offload object, and something outside Python's view keeps those
  classes (gc finds no owner and cannot collect them).

A leaked engine's gloo groups keep their ``gloo_tcp_loop`` threads, each waking ~100 times a
second: an idle rank that has run a few ZeRO-3 jobs burns CPU for the rest of its life.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

_BWD_CLASSES = ("pre_bwd_fn", "post_bwd_fn")


def destroy_engine(engine: Any) -> None:
    """``engine.destroy()``, then what DeepSpeed keeps after it: every place that is done with
    an engine (trainer, relayout, DPO reference) ends it here."""
    engine.destroy()
    release_zero3(engine.module)


def release_zero3(root: torch.nn.Module | None = None) -> int:
    """Drop DeepSpeed's lasting references to the ZeRO-3 model ``root`` (every ZeRO-3 model
    set up in this process when None: only when no ZeRO-3 engine is in use any more).

    Call after ``engine.destroy()``; returns how many closure cells were cleared."""
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is None:  # no ZeRO-3 engine was ever set up here
        return 0
    stack = offload.FWD_MODULE_STACK
    roots = [m for m in stack if root is None or m is root]
    if root is not None and not roots:
        roots = [root]
    stack[:] = [m for m in stack if not any(m is r for r in roots)]
    cleared = sum(_clear_backward_classes(m) for r in roots for m in r.modules())
    _clear_params_to_release_cache()
    return cleared


def _clear_backward_classes(module: torch.nn.Module) -> int:
    """Remove the module's per-module autograd Function classes and empty their closures."""
    cleared = 0
    for attr in _BWD_CLASSES:
        cls = module.__dict__.pop(attr, None)
        if cls is None:
            continue
        for value in vars(cls).values():
            fn = getattr(value, "__func__", value)
            for cell in getattr(fn, "__closure__", None) or ():
                cell.cell_contents = None
                cleared += 1
    return cleared


def _clear_params_to_release_cache() -> None:
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is None:
        return
    cls = coordinator.PartitionedParameterCoordinator
    wrapper = vars(cls).get("_PartitionedParameterCoordinator__params_to_release")
    for cell in getattr(wrapper, "__closure__", None) or ():  # instrument_w_nvtx's wrapper
        inner = cell.cell_contents
        if hasattr(inner, "cache_clear"):
            inner.cache_clear()
