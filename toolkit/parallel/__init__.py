"""Parallel layout (validated once) and the process groups derived from it."""

from toolkit.parallel.layout import LayoutError, ParallelLayout, ResolvedLayout

__all__ = ["LayoutError", "Mpu", "ParallelLayout", "ResolvedLayout", "check_supported", "destroy",
           "initialize"]


def __getattr__(name: str):
    # Import megatron-core lazily: layout validation must work without it (fast CLI paths).
    if name in ("Mpu", "initialize", "destroy", "check_supported"):
        from toolkit.parallel import state

        return getattr(state, name)
    raise AttributeError(name)
