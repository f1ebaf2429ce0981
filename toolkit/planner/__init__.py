"""Parallelism planner (pure functions): which layout, ZeRO stage, offload, recompute and
micro-batch to train a model with on a cluster, how long a step takes and what it costs.

``cost`` holds the analytic step-time model's knobs and terms and ``step`` composes them into
one plan's step time, ``devices`` the accelerator table, ``search`` the
enumeration ranked by the cost model and filtered by the memory model (``toolkit.memory``),
``published`` the published runs it is checked against (docs/planner.md).
"""

from toolkit.planner.cost import Candidate, Efficiency, Network, StepCost, Workload
from toolkit.planner.devices import DEVICES, Device, DeviceError, get_device, peak_tflops
from toolkit.planner.search import (
    PlanError,
    Planned,
    SearchResult,
    SearchSpace,
    check_fit,
    default_global_batch,
    explain,
    search,
)
from toolkit.planner.step import step_cost

__all__ = [
    "DEVICES", "Candidate", "Device", "DeviceError", "Efficiency", "Network", "PlanError",
    "Planned", "SearchResult", "SearchSpace", "StepCost", "Workload", "check_fit",
    "default_global_batch", "explain", "get_device", "peak_tflops", "search", "step_cost",
]
