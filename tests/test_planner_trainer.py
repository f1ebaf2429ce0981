"""Plans the planner says fit for the tiny CPU model really train: ``mdtk plan --emit`` writes
the trainer YAML + DeepSpeed JSON of each of the best layouts for 4 CPU ranks, and the trainer
runs every one of them as written, in one launch of 4 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from dist_checks import trainer_checks as tc
from dist_checks.planner_checks import run_emitted
from typer.testing import CliRunner

from toolkit.cli import app

LAYOUTS = 4


@pytest.fixture(scope="module")
def emitted(trainer_assets):
    assets, root = trainer_assets
    runner = CliRunner()
    base = ["plan", "--model", assets["dense"], "--gpu", "cpu", "--gpus-per-node", "4",
            "--gpu-mem", "4GB", "--cpu-mem", "16GB", "--seq-len", str(tc.SEQ),
            "--global-batch", str(tc.GLOBAL), "--dtype", "fp32", "--per-layout",
            "--top", str(LAYOUTS)]
    table = runner.invoke(app, base + ["--json"])
    assert table.exit_code == 0, table.output
    plans = json.loads(table.stdout)["plans"]
    assert len(plans) == LAYOUTS
    configs = []
    for rank in range(1, LAYOUTS + 1):
        folder = root / f"plan{rank}"
        res = runner.invoke(app, base + ["--emit", str(folder), "--emit-rank", str(rank),
                                         "--data", tc.PRETRAIN, "--tokenizer",
                                         assets["tokenizer"], "--steps", "2"])
        assert res.exit_code == 0, res.output
        configs.append(str(folder / "train.yaml"))
    return plans, configs


def test_emitted_plans_train_as_planned(rank_pool_4, emitted):
    plans, configs = emitted
    per_rank = rank_pool_4.run(run_emitted, configs, timeout=1200)
    assert len({(p["tp"], p["pp"], p["dp"]) for p in plans}) == LAYOUTS  # distinct layouts
    for i, plan in enumerate(plans):
        raw = yaml.safe_load(Path(configs[i]).read_text())
        ds = json.loads(Path(raw["deepspeed"]["config"]).read_text())
        assert ds["zero_optimization"]["stage"] == plan["zero_stage"]
        for rank in per_rank:
            r = rank[i]
            assert r["finite"] and len(r["losses"]) == 2, r
            assert (r["tp"], r["pp"], r["dp"]) == (plan["tp"], plan["pp"], plan["dp"])
            assert r["chunks"] == plan["vpp"]
            assert r["stage"] == plan["zero_stage"]
            assert r["offload"] == ("cpu" if plan["offload"] != "none" else "none")
            assert r["metrics"] or rank is not per_rank[0]
        assert [rank[i]["losses"] for rank in per_rank] == [per_rank[0][i]["losses"]] * 4
