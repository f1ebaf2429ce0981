"""Layout-invariant initialization and resume at another layout (``toolkit.train.init``,
``toolkit.train.checkpoints.reshard``), with the real trainer on gloo ranks.

Pretraining from a config must start from bit-identical weights at every layout (gathered to an
HF folder right after the model is built) and give the single-rank run's first losses. A
checkpoint written at one layout (dp2 ZeRO-2, tp2 x pp2 ZeRO-1, Mixtral ep2) resumed at another
(tp2, pp2, dp4 ZeRO-3, one rank, ep1) must continue with the uninterrupted run's losses: weights,
fp32 master weights, Adam moments, step counts and the data position all carry over.
(dp2 ZeRO-2 -> one rank is asserted in test_trainer.py on its resume checkpoint.) A checkpoint
converted offline to another layout (``mdtk convert --to trainer``; here from the dp4 ZeRO-3
checkpoint the resumed run writes) resumes natively there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_checks import own_cache
from dist_checks import reshard_checks as rc
from dist_checks.trainer_checks import Case

LOSS_RTOL = 1e-5
LONG = rc.FULL + 2  # the offline conversion of the step-6 checkpoint continues to here


def cases_2(work: str) -> list[Case]:
    return [
        rc.producer("p_dp2_zero2", zero=2),
        rc.producer("p_moe_ep2", model="moe", ep=2),
        Case("init_tp2", tp=2, steps=1),
        Case("init_pp2", pp=2, steps=1),
        Case("init_pp2_vpp2", pp=2, vpp=2, steps=1),
        rc.resumed("r_dp2_zero2_to_tp2_offload", "p_dp2_zero2", work, tp=2, zero=2,
                   offload="cpu"),  # DeepSpeed's CPU Adam holds the states
        rc.resumed("r_dp2_zero2_to_dp2_zero0", "p_dp2_zero2", work, zero=0),  # stage only
        rc.resumed("r_dp2_zero2_to_pp2_zero1", "p_dp2_zero2", work, pp=2, zero=1),
        # converted offline (mdtk convert --to trainer) from dp4 ZeRO-3: a native resume
        Case("r_converted_tp2_zero2", tp=2, zero=2, steps=LONG,
             overrides=(f"checkpoint.resume={Path(work) / 'converted' / 'step_0000006'}",)),
    ]


def cases_4(work: str) -> list[Case]:
    return [
        rc.producer("p_tp2_pp2_zero1", tp=2, pp=2, zero=1),
        Case("r_tp2_pp2_zero1_to_dp4_zero3", zero=3, steps=rc.FULL,  # saves at step 6
             overrides=(f"checkpoint.resume={rc.ckpt(work, 'p_tp2_pp2_zero1')}",
                        f"checkpoint.interval={rc.FULL}")),
    ]


REFS_1 = [Case("ref_dense", steps=LONG), Case("ref_moe", model="moe", steps=rc.FULL)]


def cases_1(work: str) -> list[Case]:
    return [rc.resumed("r_moe_ep2_to_ep1", "p_moe_ep2", work, model="moe")]


@pytest.fixture(scope="module")
def assets(trainer_assets):
    out, root = trainer_assets
    out["work"] = str(root / "runs")
    return out


def _by_case(per_rank) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for rank_results in per_rank:
        for r in rank_results:
            out.setdefault(r["case"], []).append(r)
    return out


@pytest.fixture(scope="module")
def results(rank_pool_1, rank_pool_2, rank_pool_4, assets):
    from toolkit.train.checkpoints.relayout import convert_checkpoint

    work = assets["work"]  # the references run in rank_pool_1 meanwhile (own data cache)
    refs = rank_pool_1.submit(rc.runs, REFS_1, own_cache(assets), work, timeout=600)
    out = _by_case(rank_pool_4.run(rc.runs, cases_4(work), assets, work, timeout=900))
    out["converted"] = convert_checkpoint(rc.ckpt(work, "r_tp2_pp2_zero1_to_dp4_zero3", rc.FULL),
                                          Path(work) / "converted", tp=2, dp=1, zero=2)
    out.update(_by_case(rank_pool_2.run(rc.runs, cases_2(work), assets, work, timeout=900)))
    out.update(_by_case(refs.result()))
    out.update(_by_case(rank_pool_1.run(rc.runs, cases_1(work), assets, work, timeout=600)))
    return out


def _tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


INIT = {  # run -> the single-rank reference it must start from
    "p_dp2_zero2": "ref_dense", "init_tp2": "ref_dense", "init_pp2": "ref_dense",
    "init_pp2_vpp2": "ref_dense", "p_tp2_pp2_zero1": "ref_dense", "p_moe_ep2": "ref_moe",
    "r_dp2_zero2_to_tp2_offload": "ref_dense", "r_tp2_pp2_zero1_to_dp4_zero3": "ref_dense",
}


@pytest.mark.parametrize("name", sorted(INIT))
def test_initial_weights_bit_identical_at_every_layout(results, name):
    ref = _tensors(results[INIT[name]][0]["init_hf"])
    got = _tensors(results[name][0]["init_hf"])
    assert sorted(got) == sorted(ref) and len(ref) > 10
    for key, tensor in ref.items():
        assert got[key].dtype == tensor.dtype and got[key].equal(tensor), (name, key)
    # not a constant: the weights of different tensors and different seeds differ
    assert not ref["model.layers.0.self_attn.q_proj.weight"].equal(
        ref["model.layers.1.self_attn.q_proj.weight"])


@pytest.mark.parametrize("name", ["p_dp2_zero2", "init_tp2", "init_pp2", "init_pp2_vpp2",
                                  "p_tp2_pp2_zero1", "p_moe_ep2"])
def test_first_losses_equal_single_rank(results, name):
    ref = results[INIT[name]][0]["losses"]
    assert ref[-1] < ref[0] - 0.1  # it trains
    for r in results[name]:
        n = len(r["losses"])
        assert n >= 1 and r["start"] == 0
        assert r["losses"] == pytest.approx(ref[:n], rel=LOSS_RTOL, abs=0), name


def test_offline_conversion_writes_a_native_checkpoint_of_the_new_layout(results):
    import json

    step = results["converted"]
    assert step.name == "step_0000006"
    assert (step.parent / "latest").read_text().strip() == step.name
    state = json.loads((step / "trainer_state.json").read_text())
    assert (state["step"], state["world_size"], state["dp_size"]) == (6, 2, 1)
    assert (state["layout"]["tp"], state["layout"]["pp"]) == (2, 1)
    assert sorted(p.name for p in (step / "engine").iterdir()) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]


RESUMED = {"r_converted_tp2_zero2": ("ref_dense", (1, 2, 1), rc.FULL, LONG),
           "r_dp2_zero2_to_tp2_offload": ("ref_dense", (1, 2, 1), rc.STOP, rc.FULL),
           "r_dp2_zero2_to_dp2_zero0": ("ref_dense", (2, 1, 1), rc.STOP, rc.FULL),
           "r_dp2_zero2_to_pp2_zero1": ("ref_dense", (1, 1, 2), rc.STOP, rc.FULL),
           "r_tp2_pp2_zero1_to_dp4_zero3": ("ref_dense", (4, 1, 1), rc.STOP, rc.FULL),
           "r_moe_ep2_to_ep1": ("ref_moe", (1, 1, 1), rc.STOP, rc.FULL)}


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_resume_at_another_layout_continues_the_run(results, name):
    ref_name, (dp, tp, pp), start, end = RESUMED[name]
    ref = results[ref_name][0]["losses"]
    assert len(ref) >= end
    for r in results[name]:
        assert (r["dp"], r["tp"], r["pp"]) == (dp, tp, pp)
        assert r["start"] == start and len(r["losses"]) == end - start
        assert r["losses"] == pytest.approx(ref[start:end], rel=LOSS_RTOL, abs=0), name


def test_init_kinds_follow_megatron_core():
    from toolkit.mapping import MappingError
    from toolkit.train.init import init_kind, tensor_seed

    kinds = {
        "embedding.word_embeddings.weight": "embedding",
        "decoder.layers.0.self_attention.linear_qkv.weight": "normal",
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "ones",
        "decoder.layers.0.self_attention.linear_qkv.bias": "zeros",
        "decoder.layers.0.self_attention.linear_proj.weight": "output",
        "decoder.layers.0.mlp.linear_fc2.weight": "output",
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight": "output",
        "decoder.layers.0.mlp.router.weight": "normal",
        "decoder.layers.0.input_layernorm.weight": "ones",
        "decoder.final_layernorm.weight": "ones",
        "decoder.final_layernorm.bias": "zeros",
        "output_layer.weight": "normal",
    }
    for key, kind in kinds.items():
        assert init_kind(key, 1 if kind in ("ones", "zeros") else 2) == kind, key
    with pytest.raises(MappingError, match="no initialization known"):
        init_kind("decoder.layers.0.mlp.some_scale", 1)
    assert tensor_seed(1, "a") == tensor_seed(1, "a") != tensor_seed(2, "a") != tensor_seed(1, "b")


def test_convert_to_trainer_refuses_a_folder_that_is_no_trainer_checkpoint(tmp_path):
    from typer.testing import CliRunner

    from toolkit.cli import app

    res = CliRunner().invoke(app, ["convert", str(tmp_path), str(tmp_path / "out"), "--to",
                                   "trainer", "--tp", "2"])
    assert res.exit_code == 2
    assert "is not a complete mdtk checkpoint" in res.output
