"""``mdtk train`` on Megatron indexed datasets (tests/dist_checks/indexed_checks.py): a blend of a
Megatron-written and a DeepSpeed-written prefix trains; stopped at step 3 and resumed at dp1 and
at tp2 it continues the uninterrupted dp2 run within 1e-5 (fp32); tokens per source are logged;
token ids above the model's vocab are refused before any process group or output."""

from __future__ import annotations

import pytest
from dist_checks import indexed_checks as ic
from dist_checks import trainer_checks as tc

from toolkit import bundled

LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def setup(trainer_assets):
    assets, root = trainer_assets
    prefixes = ic.make_prefixes(root / "indexed", assets["tokenizer"],
                                bundled.path(bundled.DATA) / "pretrain.jsonl")
    return assets, str(root / "runs"), prefixes


@pytest.fixture(scope="module")
def two(rank_pool_2, setup):
    assets, work, prefixes = setup
    first, second = rank_pool_2.run(ic.two_rank_runs, assets, work, prefixes, timeout=600)
    return [first, second]


@pytest.fixture(scope="module")
def one(rank_pool_1, setup, two):
    assets, work, prefixes = setup
    (out,) = rank_pool_1.run(ic.one_rank_resume, assets, work, prefixes, two[0]["checkpoint"],
                             timeout=300)
    return out


def test_blend_of_megatron_and_deepspeed_prefixes_trains(two):
    full = two[0]["full"]
    assert full["dp"] == 2 and len(full["losses"]) == ic.STEPS
    assert full["losses"][-1] < full["losses"][0] - 0.5  # it learns from the indexed data
    assert two[1]["full"]["losses"] == full["losses"]
    rows = full["rows"]
    assert [r["loss"] for r in rows] == full["losses"]
    last = rows[-1]["tokens_by_source"]
    assert sum(last.values()) == ic.STEPS * tc.GLOBAL * tc.SEQ
    share_a = last[next(k for k in last if k.endswith("/a"))] / sum(last.values())
    assert abs(share_a - ic.WEIGHTS[0]) < 0.05  # 48 samples: the blend's own counts


def test_resume_at_dp1_and_tp2_continues_the_run(two, one):
    full = two[0]["full"]["losses"]
    assert two[0]["first"]["losses"] == full[:3]  # the stopped run is the same run
    for r in (one, two[0]["tp2"], two[1]["tp2"]):
        assert r["start"] == 3 and len(r["losses"]) == 3
        assert r["losses"] == pytest.approx(full[3:], rel=LOSS_RTOL, abs=0), r["case"]
    assert one["dp"] == 1 and two[0]["tp2"]["tp"] == 2


def test_token_ids_above_vocab_refused_before_anything(two):
    for r in two:
        bad = r["bad"]
        assert "token id 600 is at or above the model's vocab size (512)" in bad["error"]
        assert not bad["left_initialised"] and not bad["ds_config_written"]
        assert bad["written"] == []
