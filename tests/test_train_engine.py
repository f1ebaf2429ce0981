"""Training engine: megatron-core schedules inside a real DeepSpeed engine match one-process AdamW.

Each layout trains the same tiny GPT for 5 AdamW steps (gradient clipping 1.0, as DeepSpeed does
by default) on the same global batches; its per-step losses and DeepSpeed's gradient norms must
equal the full model trained with torch.optim.AdamW in one process. All layouts of one world size
run in one pool call (the ranks stay warm); each layout is then asserted by its own test.
"""

from __future__ import annotations

import pytest
import torch
from dist_checks import engine_checks as ec

from toolkit.train.loop import engine as te

LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4

CASES_2 = [
    ec.Case("dp2_zero1_accum", zero=1, n_micro=2),
    ec.Case("dp2_zero2_accum", zero=2, n_micro=2),
    ec.Case("dp2_zero3_accum", zero=3, n_micro=2),
    ec.Case("tp2", tp=2),
    ec.Case("tp2_sp", tp=2, sp=True),
    ec.Case("pp2_accum", pp=2, n_micro=4),
    ec.Case("pp2_vpp2_accum", pp=2, vpp=2, n_micro=4),
    ec.Case("moe_ep2_zero1", ep=2, experts=4, n_micro=2),
    ec.Case("moe_ep2_zero2", ep=2, experts=4, n_micro=2, zero=2),
]
CASES_4 = [
    ec.Case("tp2_pp2", tp=2, pp=2, n_micro=4),
    ec.Case("dp2_pp2_zero2_accum", pp=2, zero=2, n_micro=2),
    ec.Case("dp2_tp2_zero3_cpu_offload", tp=2, zero=3, offload=True, n_micro=2),
]


@pytest.fixture(scope="module")
def jobs(rank_pool_2, rank_pool_4) -> dict:
    """Both pools' runs, started together (one pool's ranks wait on each other)."""
    # ZeRO-3 offload uses DeepSpeed's CPU Adam: ~50 s to compile on a cold machine (cached in
    # build/torch_extensions afterwards).
    return {"2": rank_pool_2.submit(ec.train_cases, CASES_2, timeout=900),
            "4": rank_pool_4.submit(ec.train_cases, CASES_4, timeout=900)}


@pytest.fixture(scope="module")
def results_2(jobs):
    return _by_case(jobs["2"].result())


@pytest.fixture(scope="module")
def results_4(jobs):
    return _by_case(jobs["4"].result())


def _by_case(per_rank: list[list[dict]]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for rank_results in per_rank:
        for r in rank_results:
            out.setdefault(r["case"], []).append(r)
    return out


def _assert_parity(ranks: list[dict]) -> None:
    for r in ranks:
        assert len(r["losses"]) == ec.STEPS
        assert r["losses"] == pytest.approx(r["ref"], rel=LOSS_RTOL), r
        # the norm DeepSpeed clipped with, over every shard of the model (the reference's is > 1,
        # so clipping changes every update and a wrong norm would show in the losses too)
        assert r["grad_norms"] == pytest.approx(r["ref_norms"], rel=NORM_RTOL), r
        assert min(r["ref_norms"]) > ec.CLIP
        assert r["lrs"] == [ec.LR] * ec.STEPS
    # every rank reports the same step loss (averaged over micro-batches and dp ranks)
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)


@pytest.mark.parametrize("case", CASES_2, ids=[c.name for c in CASES_2])
def test_layout_matches_single_process_adamw_2_ranks(results_2, case):
    ranks = results_2[case.name]
    assert len(ranks) == 2
    _assert_parity(ranks)
    if case.experts:
        assert all(r["local_experts"] == 2 for r in ranks)  # 4 experts over ep=2
    if case.pp > 1:
        assert sorted(r["pp_rank"] for r in ranks) == [0, 1]
    assert ranks[0]["dp"] == 2 // (case.tp * case.pp)


@pytest.mark.parametrize("case", CASES_4, ids=[c.name for c in CASES_4])
def test_layout_matches_single_process_adamw_4_ranks(results_4, case):
    ranks = results_4[case.name]
    assert len(ranks) == 4
    _assert_parity(ranks)
    assert ranks[0]["dp"] == 4 // (case.tp * case.pp)
    expected = "DeepSpeedCPUAdam" if case.offload else "AdamW"
    assert all(r["optimizer"] == expected for r in ranks)


def test_unsupported_combinations_refused_before_training(rank_pool_2):
    cases = [
        ec.Case("pp2_zero3", pp=2, zero=3, n_micro=2),
        ec.Case("pp2_zero0_clip", pp=2, zero=0, n_micro=2),
        ec.Case("moe_zero3", ep=2, experts=4, zero=3),
        ec.Case("dp2_zero0", zero=0, n_micro=2),  # supported: builds
    ]
    first, second = rank_pool_2.run(ec.refusals, cases, timeout=300)
    assert first == second
    z3_pp, z0_pp, z3_moe, z0 = first
    assert "ZeRO stage 3 with pp>1 is not supported because" in z3_pp
    assert "use zero_stage 1 or 2 with pp>1" in z3_pp.lower()
    assert "ZeRO stage 0 with gradient clipping and pp>1" in z0_pp
    assert "ZeRO stage 3 with megatron-core experts" in z3_moe
    assert z0 == ""


# -- pure parts ----------------------------------------------------------------------------------

def test_token_mean_shares_add_up_to_the_global_token_mean():
    """Two micro-batches of unequal loss-token counts: the shares add up to the sum of kept
    token losses over all kept tokens (not the mean of the two micro-batch means)."""
    from toolkit.train.loop.loss import StepCounts, sample_mean, token_mean

    per_token = [torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([[7.0, 8.0, 9.0]])]
    masks = [torch.tensor([[0, 1, 1], [0, 0, 1]]), torch.tensor([[0, 0, 1]])]
    counts = StepCounts(loss_tokens=4.0, samples=3, num_microbatches=2, dp=1)
    shares = [token_mean(p, {"loss_mask": m}, counts).item()
              for p, m in zip(per_token, masks, strict=True)]
    assert sum(shares) == pytest.approx((2 + 3 + 6 + 9) / 4)  # 5.0
    assert (11 / 3 + 9) / 2 != pytest.approx(sum(shares))  # the old mean of means: 6.33
    no_mask = token_mean(per_token[0], {}, StepCounts(6.0, 2, 1, 1)).item()
    assert no_mask == pytest.approx(3.5)
    assert counts.backward_scale == 2.0  # num_microbatches x dp
    pairs = sample_mean(torch.tensor([0.5, 1.5]), counts, samples=4)
    assert pairs.item() == pytest.approx(0.5)  # a per-pair loss: summed over the pairs, / 4


def test_optimizer_defaults_torch_adam_unless_offloading():
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2}}
    out = te.with_optimizer_defaults(base)
    assert out["optimizer"]["params"] == {"lr": 1e-3, "torch_adam": True}
    assert "torch_adam" not in base["optimizer"]["params"]  # input not modified
    offload = {**base, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert "torch_adam" not in te.with_optimizer_defaults(offload)["optimizer"]["params"]
    bad = {**offload, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    with pytest.raises(te.EngineError, match="CPU Adam"):
        te.with_optimizer_defaults(bad)
    # on CUDA torch's fused AdamW (one kernel), unless the config chose foreach or offloads
    assert te.with_optimizer_defaults(base, cuda=True)["optimizer"]["params"] == {
        "lr": 1e-3, "torch_adam": True, "fused": True}
    chosen = {**base, "optimizer": {"type": "AdamW", "params": {"foreach": True}}}
    assert "fused" not in te.with_optimizer_defaults(chosen, cuda=True)["optimizer"]["params"]
    assert "fused" not in te.with_optimizer_defaults(offload, cuda=True)["optimizer"]["params"]


@pytest.mark.parametrize("config, kw, match", [
    ({"zero_optimization": {"stage": 4}}, {"pp": 1}, "stage=4"),
    ({"zero_optimization": {"stage": 3}}, {"pp": 2}, "ZeRO stage 3 with pp>1"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, {"pp": 1}, "fp16"),
    ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
      "data_types": {"grad_accum_dtype": "fp32"}}, {"pp": 1}, "BF16_Optimizer"),
    ({"zero_optimization": {"stage": 0}}, {"pp": 1, "has_experts": True}, "experts"),
])
def test_check_supported_refuses_with_reason(config, kw, match):
    with pytest.raises(te.EngineError, match=match):
        te.check_supported(config, **kw)


@pytest.mark.parametrize("config, kw", [
    ({"zero_optimization": {"stage": 2}}, {"pp": 4}),
    ({"zero_optimization": {"stage": 1}}, {"pp": 2, "has_experts": True}),
    ({"zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}, {"pp": 2}),
    ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, {"pp": 1}),
])
def test_check_supported_accepts(config, kw):
    te.check_supported(config, **kw)
