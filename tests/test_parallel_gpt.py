"""Foundation: real megatron-core GPTModels on several gloo ranks match the one-piece model.

Every check compares the loss and every gradient slice against the same weights run as a
single tp=pp=ep=1 model (float32 on CPU: differences come only from summation order).
"""

from __future__ import annotations

import pytest
from dist_checks import gpt_checks as gc

LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-5


def _assert_parity(r: dict) -> None:
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=LOSS_RTOL), r
    assert r["grad_diff"] < GRAD_ATOL, r


@pytest.mark.parametrize("sp,attention", [(False, None), (True, None), (False, "sdpa"),
                                          (True, "sdpa")],
                         ids=["tp2", "tp2_sp", "tp2_sdpa", "tp2_sp_sdpa"])
def test_tensor_parallel_matches_single_rank(rank_pool_2, sp, attention):
    """The reference is always tp=1 with megatron-core's local attention, so the sdpa cases also
    check toolkit.models.attention.SDPAttention (the GPU default) against it: loss and grads."""
    results = rank_pool_2.run(gc.check_tensor_parallel, sp, attention)
    for r in results:
        _assert_parity(r)
        assert r["core"] == ("SDPAttention" if attention == "sdpa" else "LocalAttention")
    # each rank really holds a shard: well under the full model, more than half (norms replicate)
    for r in results:
        assert r["full_params"] / 2 < r["n_params"] < 0.6 * r["full_params"], r


@pytest.mark.parametrize("vpp", [None, 2], ids=["pp2", "pp2_vpp2"])
def test_pipeline_schedule_matches_single_rank(rank_pool_2, vpp):
    first, last = rank_pool_2.run(gc.check_pipeline, vpp)
    assert last["loss"] == pytest.approx(last["ref_loss"], rel=LOSS_RTOL), last
    for r in (first, last):
        assert r["grad_diff"] < GRAD_ATOL, r
        assert r["layers"] == 2  # 4 layers over 2 stages
        assert r["chunks"] == (vpp or 1)


def test_expert_parallel_matches_single_rank(rank_pool_2):
    for r in rank_pool_2.run(gc.check_expert_parallel):
        _assert_parity(r)
        assert r["local_experts"] == 2  # 4 experts over ep=2


def test_expert_parallel_with_tensor_parallel_and_sp(rank_pool_4):
    for r in rank_pool_4.run(gc.check_expert_parallel, 2):
        _assert_parity(r)
        assert r["local_experts"] == 2


def test_deepspeed_zero_stages_dp2_tp2_match_torch_adamw(rank_pool_4):
    results = rank_pool_4.run(gc.check_deepspeed_zero, [1, 2, 3], timeout=600)
    for r in results:
        ref = r["ref"]
        assert ref[-1] < ref[0]  # the reference itself learns
        for stage in (1, 2, 3):
            assert r[stage] == pytest.approx(ref, rel=LOSS_RTOL), (stage, r)


def test_initialize_rejects_layout_not_matching_world(rank_pool_2):
    from toolkit.parallel import ParallelLayout

    for msg in rank_pool_2.run(gc.check_initialize_rejects, ParallelLayout(tp=2, pp=2)):
        assert "world size 2 is not divisible by tp*pp*cp = 2*2*1 = 4" in msg


def test_mpu_adapter_follows_megatron_rank_order(rank_pool_4):
    from toolkit.parallel import ParallelLayout

    results = rank_pool_4.run(gc.check_mpu, ParallelLayout(tp=2))
    # megatron order tp-cp-ep-dp-pp: tp is the fastest-moving index
    assert [r["tp"] for r in results] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert [r["dp"] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert [r["dp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # DeepSpeed's "model parallel" = tp x pp, here just tp
    assert [r["mp"] for r in results] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    results = rank_pool_4.run(gc.check_mpu, ParallelLayout(tp=2, pp=2))
    assert [r["pp"] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert [r["mp"][0] for r in results] == [4, 4, 4, 4]
    assert [r["dp"] for r in results] == [(1, 0)] * 4


def test_destroy_releases_process_group_threads(rank_pool_2):
    """Trying several layouts in one process must not accumulate gloo threads (megatron-core's
    destroy only forgets its groups; each used gloo group keeps 2 threads alive)."""
    for counts in rank_pool_2.run(gc.check_layout_cycles_release_threads):
        assert counts[-1] <= counts[0], counts


def test_destroy_releases_deepspeed_mpu(rank_pool_2):
    """Regression: a DeepSpeed engine built without an mpu after mdtk's layout was destroyed
    used DeepSpeed's stale global mpu and failed on megatron-core's missing groups."""
    for r in rank_pool_2.run(gc.check_engine_after_destroy_without_mpu):
        assert r["held"]  # DeepSpeed really cached mdtk's mpu (else this test proves nothing)
        assert r["dp"] == 2 and r["loss"] > 0, r
