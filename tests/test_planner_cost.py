"""The planner's cost terms against values computed by hand (deterministic, no ranks)."""

from __future__ import annotations

import dataclasses

import pytest

from toolkit.memory import load_model_shape
from toolkit.planner import DEVICES, Candidate, Efficiency, Network, Workload, step_cost
from toolkit.planner.cost import (
    FSDP,
    MDTK,
    MEGATRON_LM,
    cp_exchange_bytes,
    cpu_adam_seconds,
    offload_bytes,
    pp_bubble_fraction,
    ring_time,
    tp_collectives_per_layer,
    zero_traffic,
)
from toolkit.planner.flops import matmul_params_per_token, model_flops_per_token

H100 = DEVICES["h100"]
LLAMA_1B = load_model_shape("llama-3.2-1b")
LLAMA_8B = load_model_shape("llama-3.1-8b")
EFF = Efficiency()


def test_pipeline_bubble_fraction():
    assert pp_bubble_fraction(4, 8) == 3 / 8  # (pp-1) / m
    assert pp_bubble_fraction(4, 8, vpp=2) == 3 / 16  # interleaving divides it by vpp
    assert pp_bubble_fraction(1, 8) == 0.0


def test_pipeline_bubble_in_the_step():
    """1F1B: step = m * t_stage + (pp-1)/vpp * t_stage; the bubble line is the second term.
    A 128-word vocabulary makes the stages equal (no LM head to speak of on the last one)."""
    uniform = dataclasses.replace(LLAMA_8B, vocab=128, name="uniform")
    work = Workload(2048, 64)
    for vpp in (1, 2):
        c = Candidate(tp=1, pp=4, dp=2, vpp=vpp, zero=1, micro_batch=1)
        cost = step_cost(uniform, work, c, Network(H100, 8))
        m = cost.num_microbatches
        assert m == 32
        t_stage = cost.compute / m  # one stage's compute per micro-batch
        assert cost.pp_bubble == pytest.approx(3 / vpp * t_stage, rel=1e-3)
        assert cost.pp_bubble / (cost.compute) == pytest.approx(pp_bubble_fraction(4, m, vpp),
                                                                rel=1e-3)
    # with the real vocabulary the last stage is the slowest: the bubble uses the mean stage
    cost = step_cost(LLAMA_8B, work, Candidate(pp=4, dp=2, zero=1), Network(H100, 8))
    assert cost.pp_bubble < 3 * cost.compute / cost.num_microbatches


def test_tp_all_reduce_count_per_layer_and_volume():
    assert tp_collectives_per_layer("none") == 4  # 2 forward (attention, MLP), 2 backward
    assert tp_collectives_per_layer("selective") == 4  # core attention has no TP collective
    assert tp_collectives_per_layer("full") == 6  # the recomputed forward repeats its 2
    # sequence parallelism: all-gather + reduce-scatter pairs, and the backward re-gathers the
    # inputs of the QKV and fc1 column-parallel linears for their weight gradients
    assert tp_collectives_per_layer("none", sequence_parallel=True) == 5
    assert tp_collectives_per_layer("full", sequence_parallel=True) == 7
    work = Workload(4096, 16)
    for recompute, count in (("none", 5), ("full", 7)):  # the planner pairs tp with SP
        c = Candidate(tp=4, dp=2, zero=1, micro_batch=2, recompute=recompute)
        cost = step_cost(LLAMA_8B, work, c, Network(H100, 8))
        m = 16 // (2 * 2)
        payload = 4096 * 2 * 4096 * 2  # tokens x hidden x bf16 of one micro-batch
        assert cost.volumes["tp"] == m * 32 * count * payload


def test_ring_factors():
    # all-reduce moves 2(n-1)/n of the payload per rank, all-gather and reduce-scatter (n-1)/n
    assert ring_time(8e9, 8, "allreduce", 1e9, 0.0) == pytest.approx(14.0)
    assert ring_time(8e9, 8, "allgather", 1e9, 1e-3) == pytest.approx(7.001)
    assert ring_time(8e9, 1, "allreduce", 1e9, 1e-3) == 0.0


def test_zero3_gather_volume():
    """ZeRO-3 all-gathers every parameter for each micro-batch's forward and backward and
    reduce-scatters the gradients every micro-batch."""
    t = zero_traffic(3, 1e9, n=8, m=4, e_param=2, e_grad=2, per_micro=True)
    assert t == {"reducescatter": 4 * 1e9 * 2, "allgather": 2 * 4 * 1e9 * 2}
    # ZeRO-1/2: gradients reduce-scattered (per micro-batch in DeepSpeed, once in Megatron),
    # the updated parameters all-gathered once; ZeRO-0: one all-reduce
    assert zero_traffic(1, 1e9, 8, 4, 2, 2, True) == {"reducescatter": 8e9, "allgather": 2e9}
    assert zero_traffic(1, 1e9, 8, 4, 2, 4, False) == {"reducescatter": 4e9, "allgather": 2e9}
    assert zero_traffic(0, 1e9, 8, 4, 2, 2, True) == {"allreduce": 2e9}
    assert zero_traffic(3, 1e9, 1, 4, 2, 2, True) == {}
    # in a step: llama-3.2-1b, dp8, 4 micro-batches: the whole model gathered 8 times in bf16
    c = Candidate(dp=8, zero=3, micro_batch=2)
    cost = step_cost(LLAMA_1B, Workload(2048, 64), c, Network(H100, 8))
    n = LLAMA_1B.num_params()
    assert cost.volumes["dp_allgather"] == 2 * 4 * n * 2
    assert cost.volumes["dp_reducescatter"] == 4 * n * 2
    fsdp = step_cost(LLAMA_1B, Workload(2048, 64), c, Network(H100, 8), FSDP)
    assert fsdp.volumes["dp_reducescatter"] == 4 * n * 4  # FSDP reduces in fp32


def test_cp_exchange_bytes():
    # llama-3.1-8b, seq 8192 split over cp=4 (2048 tokens a rank), tp=2: the forward sends its
    # K and V blocks (2048 x 1024/2 bf16 each) 3 times, the backward twice that again
    fwd = 3 * 2 * 2048 * (1024 / 2) * 2
    assert cp_exchange_bytes(LLAMA_8B, 2048, cp=4, tp=2, e=2, recompute="none") == 3 * fwd
    assert cp_exchange_bytes(LLAMA_8B, 2048, 4, 2, 2, "full") == 4 * fwd
    assert 3 * fwd == 37_748_736
    assert cp_exchange_bytes(LLAMA_8B, 2048, 1, 2, 2, "none") == 0.0
    c = Candidate(tp=2, cp=4, dp=1, zero=1, micro_batch=1)
    cost = step_cost(LLAMA_8B, Workload(8192, 1), c, Network(H100, 8))
    assert cost.volumes["cp"] == 32 * 3 * fwd


def test_offload_transfer_and_cpu_adam():
    # optimizer offload: the reduced gradient partition goes down every micro-batch (ZeRO-2/3),
    # the updated 16-bit partition comes back once; parameter offload fetches it twice more
    # per micro-batch (forward and backward)
    assert offload_bytes(3, "optimizer", 1e9, m=4, e=2, e_grad=2) == (8e9, 2e9)
    assert offload_bytes(3, "all", 1e9, m=4, e=2, e_grad=2) == (8e9, 2e9 + 2 * 4 * 2e9)
    assert offload_bytes(2, "none", 1e9, 4, 2, 2) == (0.0, 0.0)
    # DGX H100 host: 2 sockets x 8 channels x DDR5-4800 x 8 bytes = 614.4 GB/s, half of it
    # achieved, shared by 8 ranks; 30 bytes per parameter -> 1e9 parameters in 0.78125 s
    assert H100.host_mem == pytest.approx(614.4e9)
    assert cpu_adam_seconds(1e9, H100, 8, EFF) == pytest.approx(30e9 / (614.4e9 * 0.5 / 8))
    assert cpu_adam_seconds(1e9, H100, 8, EFF) == pytest.approx(0.78125)
    c = Candidate(dp=8, zero=3, offload="optimizer", micro_batch=1)
    cost = step_cost(LLAMA_8B, Workload(4096, 32), c, Network(H100, 8))
    shard = LLAMA_8B.num_params() / 8
    assert cost.volumes["offload_to_host"] == pytest.approx(4 * shard * 2)
    assert cost.volumes["offload_to_device"] == pytest.approx(shard * 2)
    assert cost.optimizer == pytest.approx(cpu_adam_seconds(shard, H100, 8, EFF))
    assert cost.offload == pytest.approx(shard * 2 / (H100.pcie * EFF.pcie))


def test_rail_bandwidth():
    net = Network(H100, 8)
    assert net.bandwidth(8, 1, EFF) == (450e9 * EFF.network, H100.latency_intra)  # NVLink
    # 64 ranks, 8 per node: NCCL runs a ring per rail, 8 NICs in parallel (capped by NVLink)
    assert net.bandwidth(64, 1, EFF)[0] == pytest.approx(min(450e9, 8 * 50e9) * EFF.network)
    # data parallelism across tp=8: one rank per node, one NIC
    assert net.bandwidth(48, 8, EFF)[0] == pytest.approx(50e9 * EFF.network)
    assert net.bandwidth(48, 8, EFF)[1] == H100.latency_inter
    # no NVLink (L40S): PCIe inside the node
    assert Network(DEVICES["l40s"], 8).bandwidth(4, 1, EFF)[0] == pytest.approx(
        32e9 * EFF.network)


def test_compute_term_and_mfu_by_hand():
    """One GPU, no communication: time = matmul FLOPs / (peak x matmul eff) + attention FLOPs /
    (peak x attention eff) (elementwise traffic made free); MFU from model FLOPs."""
    eff = dataclasses.replace(EFF, memory=1e12, logits_bytes=0.0, optimizer_bytes=0.0)
    work = Workload(2048, 8)
    tokens = 8 * 2048
    # Llama-3.2-1B: per layer q, o 2048^2, k, v 2048 x 512, MLP 3 x 2048 x 8192; tied head
    layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192
    assert layer == 60_817_408
    head = 128256 * 2048
    n = 16 * layer + head  # norms are elementwise work, not matmuls
    assert matmul_params_per_token(LLAMA_1B) == n + 33 * 2048  # PaLM's N counts the norms
    att = 12 * 16 * 2048 * 2048
    peak = 989e12
    c = Candidate(dp=1, zero=1, micro_batch=8)
    cost = step_cost(LLAMA_1B, work, c, Network(H100, 8), eff=eff)
    want = tokens * 6 * n / (peak * eff.matmul) + tokens * att / (peak * eff.attention)
    assert cost.compute == pytest.approx(want, rel=1e-12)
    assert cost.step == pytest.approx(want, rel=1e-12)
    assert cost.mfu == pytest.approx(model_flops_per_token(LLAMA_1B, 2048) * tokens / want
                                     / peak, rel=1e-12)
    assert model_flops_per_token(LLAMA_1B, 2048) == 6 * (n + 33 * 2048) + att
    # full recompute repeats the layers' forward (not the LM head's): 4/3 of their FLOPs
    full = step_cost(LLAMA_1B, work, dataclasses.replace(c, recompute="full"),
                     Network(H100, 8), eff=eff)
    want_full = (tokens * (6 * 16 * layer * 4 / 3 + 6 * head) / (peak * eff.matmul)
                 + tokens * att * 4 / 3 / (peak * eff.attention))
    assert full.compute == pytest.approx(want_full, rel=1e-12)
    # selective recompute: the core attention's forward once more
    sel = step_cost(LLAMA_1B, work, dataclasses.replace(c, recompute="selective"),
                    Network(H100, 8), eff=eff)
    assert sel.compute - cost.compute == pytest.approx(tokens * att / 3 / (peak * eff.attention))


def test_frameworks_differ_only_where_they_should():
    work = Workload(4096, 64)
    c = Candidate(tp=8, pp=1, dp=8, zero=1, micro_batch=1)
    net = Network(H100, 8)
    mdtk, meg = step_cost(LLAMA_8B, work, c, net, MDTK), step_cost(LLAMA_8B, work, c, net,
                                                                    MEGATRON_LM)
    assert mdtk.compute == meg.compute
    assert meg.tp_comm == pytest.approx(mdtk.tp_comm * (1 - MEGATRON_LM.tp_overlap))
    # DeepSpeed reduce-scatters per micro-batch, Megatron's distributed optimizer once
    assert mdtk.volumes["dp_reducescatter"] == 8 * meg.volumes["dp_reducescatter"]


def test_eager_attention_scores_go_through_memory():
    """Without flash attention each layer moves the [heads, s, s] scores 6 times a forward
    (QK^T written, scale+mask, softmax, read by AV), 3 forwards' worth with the backward."""
    from toolkit.planner.cost import EAGER_SCORE_PASSES

    eff = dataclasses.replace(EFF, optimizer_bytes=0.0)
    c = Candidate(dp=1, zero=1, micro_batch=2)
    flash = step_cost(LLAMA_1B, Workload(1024, 2), c, Network(H100, 8), eff=eff)
    eager = step_cost(LLAMA_1B, Workload(1024, 2, flash=False), c, Network(H100, 8), eff=eff)
    scores = EAGER_SCORE_PASSES * 2 * 32 * 1024 * (2 * 1024) * 16 * 3  # bytes a step
    assert EAGER_SCORE_PASSES == 6
    assert eager.compute - flash.compute == pytest.approx(scores / (H100.hbm * eff.memory))


def test_every_traffic_kind_names_its_link():
    """Bytes and seconds stay apart, and each traffic kind says which link carries it: tp inside
    the node's NVLink domain, the pipeline and dp groups (strided by tp=8) across nodes, offload
    over the host link."""
    c = Candidate(tp=8, pp=2, dp=4, zero=2, offload="optimizer")
    cost = step_cost(LLAMA_8B, Workload(4096, 32), c, Network(H100, 8))
    assert cost.links == {"tp": "gpu link", "pp": "network", "dp_reducescatter": "network",
                          "dp_allgather": "network", "offload_to_host": "pcie",
                          "offload_to_device": "pcie"}
    assert set(cost.links) == {k for k, v in cost.volumes.items() if v}
    assert Network(DEVICES["l40s"], 8).link(4, 1, EFF).name == "pcie"  # no NVLink domain
