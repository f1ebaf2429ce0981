"""Fit the planner's efficiency constants on some published runs, report the error on all.

    python scripts/calibrate_planner.py            # grid search, then the table for docs/planner.md
    python scripts/calibrate_planner.py --report   # only the table, with the constants in cost.py

The fit minimises the mean squared log error of tokens/s per GPU over the calibration runs
(``toolkit.planner.calibration.CALIBRATE``) by grid search over the calibrated constants; the
other runs are held out. The fitted values are then written into ``toolkit/planner/cost.py``
(``Efficiency``) by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.planner.calibration import (  # noqa: E402
    CALIBRATE,
    PUBLISHED_BUDGET,
    check,
    pinned,
)
from toolkit.planner.cost import FRAMEWORKS, Efficiency, Network  # noqa: E402
from toolkit.planner.devices import get_device  # noqa: E402
from toolkit.planner.published import PUBLISHED, PublishedRun  # noqa: E402
from toolkit.planner.search import search  # noqa: E402
from toolkit.planner.step import step_cost  # noqa: E402

GRID = {
    "matmul": [0.40 + 0.025 * i for i in range(17)],
    "attention": [0.20 + 0.05 * i for i in range(15)],
    "memory": [0.10, 0.15, 0.20, 0.30, 0.40, 0.50, 0.70],
    "network": [0.5, 0.6, 0.7, 0.8, 0.9],
}


def fitting_candidates(run: PublishedRun):
    """Every plan of the published layout that fits (the unstated knobs free)."""
    work, cluster, space = pinned(run)
    res = search(run.model, work, cluster, get_device(run.device), top=10_000, space=space,
                 framework=FRAMEWORKS[run.framework], group=lambda c: c,
                 budget=PUBLISHED_BUDGET)
    return work, cluster, [p.candidate for p in res.plans]


def predicted(run, work, cluster, cands, eff) -> float:
    net = Network(get_device(run.device), cluster.gpus_per_node)
    return max(step_cost(run.model, work, c, net, FRAMEWORKS[run.framework], eff
                         ).tokens_per_s_per_gpu for c in cands)


def fit() -> Efficiency:
    runs = [r for r in PUBLISHED if r.name in CALIBRATE]
    prepared = [(r, *fitting_candidates(r)) for r in runs]
    best, best_loss = None, math.inf
    keys = list(GRID)
    for values in itertools.product(*(GRID[k] for k in keys)):
        eff = dataclasses.replace(Efficiency(), **dict(zip(keys, values, strict=True)))
        loss = sum(math.log(predicted(r, w, cl, cs, eff) / r.tokens_per_s_per_gpu) ** 2
                   for r, w, cl, cs in prepared) / len(prepared)
        if loss < best_loss:
            best, best_loss = eff, loss
    print(f"fitted on {len(prepared)} runs: " + ", ".join(
        f"{k}={getattr(best, k):.3g}" for k in keys) + f" (rms log error {best_loss ** .5:.3f})")
    return best


def report(eff: Efficiency) -> None:
    print("| run | set | published tok/s/GPU | predicted | error | plan for the published "
          "layout | rank of the layout |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    errors = {"calibration": [], "held out": []}
    for run in PUBLISHED:
        c = check(run, eff)
        kind = "calibration" if run.name in CALIBRATE else "held out"
        if c.error is not None:
            errors[kind].append(abs(c.error))
        plan = c.plan.candidate.describe() if c.plan else "does not fit"
        err = f"{c.error:+.1%}" if c.error is not None else "-"
        print(f"| {run.name} | {kind} | {run.tokens_per_s_per_gpu:,.0f} | "
              f"{c.predicted or 0:,.0f} | {err} | {plan} | {c.rank} |")
    for kind, errs in errors.items():
        print(f"{kind}: mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%} "
              f"({len(errs)} runs)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", action="store_true", help="skip the fit")
    args = p.parse_args()
    report(Efficiency() if args.report else fit())


if __name__ == "__main__":
    main()
