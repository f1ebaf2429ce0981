"""The GPU paths of the benchmark scripts, run on CPU ranks with tiny shapes
(tests/dist_checks/bench_checks.py): scripts/gpu_check.py runs them only on a GPU, where a
broken call costs a GPU window."""

from __future__ import annotations

import math
from pathlib import Path

from dist_checks import bench_checks


def test_bench_train_bare_loop_and_trainer_run(rank_pool_2, trainer_assets):
    assets, root = trainer_assets
    # a config.json, no weights: the GPU part's pretraining path (random init per tensor)
    mine = {"config": str(Path(assets["dense"]) / "config.json"),
            "tokenizer": assets["tokenizer"], "cache": assets["cache"]}
    r0, _ = rank_pool_2.run(bench_checks.bench_train_compare, mine, str(root / "bench_train"),
                            timeout=300)
    # steps WARMUP + 2: two timed bare steps, two trainer intervals (after the first step)
    assert len(r0["bare"]) == 2 and len(r0["trainer"]) == 2, r0
    assert all(0 < t < 60 for t in r0["bare"] + r0["trainer"]), r0
    assert math.isfinite(r0["overhead_pct"]) and r0["tokens_per_s"] > 0, r0
