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


def test_bench_dpo_predicts_from_the_memory_model():
    # the GPU check's dpo part ended in a TypeError here on the H200 (2026-11-28): est.gpu()
    import argparse

    from dist_checks import load_script

    out = load_script("bench_dpo").predicted(argparse.Namespace(seq=512, micro=4))
    assert set(out) == {"sft", "dpo", "dpo_precomputed"}
    # a reference model adds its weights; precomputed log-probs do not
    assert out["dpo"]["gpu_peak_gib"] > out["dpo_precomputed"]["gpu_peak_gib"] > 0
    assert out["dpo"]["model_states_gib"] > out["sft"]["model_states_gib"] > 0


def test_bench_checkpoint_explains_a_difference(tmp_path):
    import torch
    from dist_checks import load_script

    bench = load_script("bench_checkpoint")
    flat = torch.arange(16, dtype=torch.float32)
    state = {"module": {"a": flat[:8], "b": flat[8:]}, "steps": 3, "shapes": {"a": torch.Size([8])}}
    torch.save(state, tmp_path / "x.pt")
    torch.save(state, tmp_path / "same.pt")
    assert bench.explain_difference(tmp_path / "x.pt", tmp_path / "same.pt") == {
        "entries": {}, "values": []}
    flat[9] = -1.0  # a value in the second view of the shared storage
    state["steps"] = 4
    torch.save(state, tmp_path / "y.pt")
    why = bench.explain_difference(tmp_path / "x.pt", tmp_path / "y.pt")
    assert why["values"] == [".module.b: 1 of 8 values differ (max abs 10)", ".steps: '3' vs '4'"]
    # 9.0 -> -1.0: the two high bytes of the little-endian fp32 at byte 36 (element 9)
    assert why["entries"]["data/0"] == "2 of 64 bytes differ, offsets 38..39", why
    assert ".data/serialization_id" in why["entries"], why  # torch's hash of the records
    assert why["entries"]["data.pkl"].startswith("op "), why
