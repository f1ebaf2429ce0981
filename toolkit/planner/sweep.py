"""Best plan per GPU count, the time and cost to train a number of tokens, and its plot.

The global batch is the same for every GPU count (the training recipe does not change with the
cluster): by default about 1M tokens, a multiple of every count's world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from toolkit.memory import Cluster, ModelShape
from toolkit.planner.cost import Workload
from toolkit.planner.devices import Device
from toolkit.planner.search import Budget, PlanError, Planned, SearchSpace, search


@dataclass(frozen=True)
class SweepRow:
    gpus: int
    plan: Planned | None  # None: nothing fits
    hours: float | None
    cost: float | None  # in money with a price, else GPU-hours
    reason: str = ""


def sweep_global_batch(seq_len: int, counts: Sequence[int], tokens_per_step: int = 2**20) -> int:
    """About ``tokens_per_step`` tokens, a multiple of every GPU count."""
    lcm = math.lcm(*counts)
    return lcm * max(1, math.ceil(tokens_per_step / seq_len / lcm))


def cluster_for(gpus: int, gpus_per_node: int, template: Cluster) -> Cluster:
    """``gpus`` devices in nodes of ``gpus_per_node`` (a smaller count: one partial node)."""
    if gpus < gpus_per_node:
        return Cluster(1, gpus, template.gpu_mem, template.cpu_mem)
    if gpus % gpus_per_node:
        raise PlanError(f"{gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes: use "
                        f"multiples of {gpus_per_node} (or fewer than one node).")
    return Cluster(gpus // gpus_per_node, gpus_per_node, template.gpu_mem, template.cpu_mem)


def sweep(model: ModelShape, work: Workload, counts: Sequence[int], template: Cluster,
          device: Device, tokens: float, price: float | None = None,
          space: SearchSpace = SearchSpace(), budget: Budget = Budget()) -> list[SweepRow]:
    """The fastest plan for each GPU count and its time / cost for ``tokens``."""
    rows = []
    for n in counts:
        cluster = cluster_for(n, template.gpus_per_node, template)
        try:
            result = search(model, work, cluster, device, top=1, space=space, budget=budget)
        except PlanError as e:
            rows.append(SweepRow(n, None, None, None, str(e)))
            continue
        if not result.plans:
            rows.append(SweepRow(n, None, None, None, "; ".join(result.reasons[:1])
                                 or "nothing fits"))
            continue
        plan = result.plans[0]
        hours = tokens / (plan.cost.tokens_per_s_per_gpu * n) / 3600
        rows.append(SweepRow(n, plan, hours, hours * n * (price if price is not None else 1.0)))
    return rows


def marks(rows: Sequence[SweepRow]) -> tuple[int | None, int | None]:
    """GPU counts of the fastest and of the cheapest row."""
    ok = [r for r in rows if r.plan is not None]
    if not ok:
        return None, None
    return (min(ok, key=lambda r: (r.hours, r.gpus)).gpus,
            min(ok, key=lambda r: (r.cost, r.gpus)).gpus)


def figure(rows: Sequence[SweepRow], title: str, priced: bool) -> Any:
    """A matplotlib Figure: time (left axis) and cost (right axis) against the GPU count, the
    fastest and the cheapest marked. Needs matplotlib (a dependency of mdtk)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the sweep plot needs matplotlib (a dependency of mdtk: pip install "
                          "matplotlib); the table above does not.") from e
    ok = [r for r in rows if r.plan is not None]
    fastest, cheapest = marks(rows)
    fig = Figure(figsize=(7, 4.2), dpi=120)
    ax = fig.add_subplot()
    xs = [r.gpus for r in ok]
    ax.plot(xs, [r.hours for r in ok], "o-", color="tab:blue", label="time")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("hours to train", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [r.cost for r in ok], "s--", color="tab:orange", label="cost")
    ax2.set_ylabel("cost" if priced else "GPU-hours", color="tab:orange")
    for r in ok:
        if r.gpus == fastest:
            ax.annotate("fastest", (r.gpus, r.hours), textcoords="offset points", xytext=(0, 10),
                        ha="center", color="tab:blue", weight="bold")
            ax.plot([r.gpus], [r.hours], "o", ms=12, mfc="none", color="tab:blue")
        if r.gpus == cheapest:
            ax2.annotate("cheapest", (r.gpus, r.cost), textcoords="offset points",
                         xytext=(0, 12), ha="center", color="tab:orange", weight="bold")
            ax2.plot([r.gpus], [r.cost], "s", ms=12, mfc="none", color="tab:orange")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig
