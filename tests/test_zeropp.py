"""ZeRO++ (hpZ, qwZ, qgZ) and MiCS: the traffic model, the memory model, ds-config's choice and
its reasons, the lint, DeepSpeed's parser on every generated ZeRO++ config, and real engines and
mdtk's trainer on CPU gloo ranks (hpZ runs and equals plain ZeRO-3; qwZ/qgZ are refused with
DeepSpeed's reason). The GPU side (qwZ/qgZ kernels) is scripts/bench_zeropp.py in the GPU
check."""

from __future__ import annotations

import dataclasses
import json

import pytest
from dist_checks import memory_checks as mc
from dist_checks import zeropp_checks as zc
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.dsconfig import ConfigError, Request, deepspeed_errors, generate, lint
from toolkit.memory import GIB, Cluster, TrainShape, ZeroOptions, estimate, load_model_shape
from toolkit.memory.model import model_shape_from_hf
from toolkit.parallel.layout import ParallelLayout
from toolkit.planner import DEVICES, Candidate, Network, Workload, step_cost
from toolkit.planner.cost import Efficiency
from toolkit.planner.devices import get_device, network_inter
from toolkit.planner.zero_auto import zero_auto
from toolkit.planner.zeropp import INT4, QWZ_GROUP, SCALE_BYTES, Zero3Group, ZeroPP, zero3_transfers

H100 = DEVICES["h100"]
LLAMA_70B = load_model_shape("llama-3.1-70b")
LOSS_RTOL = 1e-5


# -- the traffic model ---------------------------------------------------------------------------

def test_transfers_by_hand():
    """64 ranks, 8 a node, 1e9 parameters, 2 micro-batches, bf16: what one rank sends where."""
    group = Zero3Group(Network(H100, 8), Efficiency(), n=64, stride=1, hidden=8192)
    f, psi = 63 / 64, 1e9

    def by_kind(zpp):
        return {t.kind: t for t in zero3_transfers(group, psi, 2, 2, 2, zpp)}

    plain = by_kind(ZeroPP())
    assert plain["dp_allgather"].calls == 4  # forward and backward of each micro-batch
    assert plain["dp_allgather"].inter == pytest.approx(4 * f * 2 * psi / 8)  # 1/8 leaves
    assert plain["dp_allgather"].intra == pytest.approx(4 * f * 2 * psi * 7 / 8)
    assert plain["dp_reducescatter"].calls == 2
    assert plain["dp_reducescatter"].inter == pytest.approx(2 * f * 2 * psi / 8)
    hpz = by_kind(ZeroPP(hpz=8))
    assert hpz["dp_allgather"].calls == 1  # only the step's first gather crosses the dp group
    assert hpz["dp_allgather_hpz"].calls == 3  # 2m - 1 from the secondary copy, in the node
    assert hpz["dp_allgather_hpz"].inter == 0.0
    assert hpz["dp_allgather_hpz"].intra == pytest.approx(3 * 7 / 8 * 2 * psi)
    assert hpz["dp_allgather_hpz"].link == "gpu link"
    qwz = by_kind(ZeroPP(qwz=True))  # int8 and one fp32 scale per QWZ_GROUP elements
    assert qwz["dp_allgather"].payload == pytest.approx(4 * psi * (1 + SCALE_BYTES / QWZ_GROUP))
    qgz = by_kind(ZeroPP(qgz=True))
    assert "dp_reducescatter" not in qgz
    full = psi * (INT4 + SCALE_BYTES / 8192)
    assert qgz["dp_alltoall_qgz"].intra == pytest.approx(2 * full * 7 / 8)
    assert qgz["dp_alltoall_qgz"].inter == pytest.approx(2 * full / 8 * 7 / 8)
    one_node = Zero3Group(Network(H100, 8), Efficiency(), n=8, stride=1, hidden=8192)
    kinds = [t.kind for t in zero3_transfers(one_node, psi, 2, 2, 2, ZeroPP(qgz=True))]
    assert "dp_alltoall_qgz" not in kinds  # DeepSpeed uses qgZ only across nodes


def _cost(model, c, global_batch, inter=None):
    net = Network(get_device("h100", inter=inter), 8)
    return step_cost(model, Workload(4096, global_batch), c, net)


def test_llama70b_8x8_cross_node_bytes_a_quarter():
    """The issue's figure: Llama-3.1-70B on 8 x 8 H100 at ZeRO-3 (dp 64, one micro-batch a step
    as in the paper's per-iteration count): hpZ + qwZ + qgZ send about a quarter of plain
    ZeRO-3's bytes across nodes (arXiv 2306.10209: 3M -> 0.75M)."""
    base = Candidate(dp=64, zero=3, recompute="full")
    plain = _cost(LLAMA_70B, base, 64)
    zpp = _cost(LLAMA_70B, dataclasses.replace(base, hpz=8, qwz=True, qgz=True), 64)
    ratio = zpp.cross_node_bytes / plain.cross_node_bytes
    f = 63 / 64  # the ring's share; qgZ's inter-node all-to-all sends (N-1)/N = 7/8
    assert ratio == pytest.approx((f * (1 + 4 / 8000) + 7 / 8 * (0.5 + 4 / 8192)) / (6 * f),
                                  rel=1e-6)
    assert 0.22 < ratio < 0.26
    assert set(zpp.sent_inter) == {"dp_allgather", "dp_allgather_hpz", "dp_alltoall_qgz"}
    assert zpp.sent_inter["dp_allgather_hpz"] == 0.0
    # with 4 micro-batches a step DeepSpeed serves 7 of the 8 gathers from hpZ's copy
    plain4 = _cost(LLAMA_70B, base, 256)
    zpp4 = _cost(LLAMA_70B, dataclasses.replace(base, hpz=8, qwz=True, qgz=True), 256)
    assert zpp4.cross_node_bytes / plain4.cross_node_bytes == pytest.approx(
        (f * (1 + 4 / 8000) + 4 * 7 / 8 * (0.5 + 4 / 8192)) / (6 * 4 * f), rel=1e-6)


def test_zeropp_pays_only_on_a_slow_network():
    base = Candidate(dp=64, zero=3, recompute="full")
    for inter, pays in ((None, False), (network_inter("ethernet", 8), True)):
        plain = _cost(LLAMA_70B, base, 64, inter)
        hpz = _cost(LLAMA_70B, dataclasses.replace(base, hpz=8), 64, inter)
        assert hpz.cross_node_bytes < plain.cross_node_bytes
        assert (hpz.step < 0.9 * plain.step) == pays, (inter, hpz.step, plain.step)
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        Candidate(zero=2, hpz=8)


# -- the memory model ----------------------------------------------------------------------------

def test_memory_items():
    model = LLAMA_70B
    zero = ZeroOptions(stage=3, hpz=8, quantized_weights=True, quantized_gradients=True)
    est = estimate(model, TrainShape(seq_len=4096, recompute="full"), ParallelLayout().resolve(64),
                   zero)
    items = {i.what.split(" (")[0]: i for i in est.items}
    secondary = items["hpZ secondary parameter partition"]
    partitioned = est.params.dense - est.params.persistent  # small tensors stay whole
    assert secondary.bytes == 2 * -(-partitioned // 8) and not secondary.transient
    assert items["qwZ int8 gather buffer + fp16 dequantized copy"].transient
    assert items["qgZ int4 all-to-all buffers"].transient
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        ZeroOptions(stage=2, hpz=8)


# -- ds-config: the choice and its reasons -------------------------------------------------------

def _ds(*args: str) -> tuple[str, dict]:
    out = CliRunner().invoke(app, ["ds-config", *args])
    assert out.exit_code == 0, out.output
    text = out.output
    return text, json.loads(text[text.index("{\n"):text.rindex("}") + 1])


def test_ds_config_chooses_hpz_across_nodes_and_says_why():
    for network in ("ib", "ethernet"):
        text, cfg = _ds("--nodes", "8", "--gpus-per-node", "8", "--model", "llama-3.1-70b",
                        "--network", network)
        zero = cfg["zero_optimization"]
        assert zero["stage"] == 3 and zero["zero_hpz_partition_size"] == 8, network
        assert "zero_quantized_weights" not in zero  # lossy: only when allowed
        assert "ZeRO++ hpZ (zero_hpz_partition_size=8" in text
        assert "with plain ZeRO-3" in text and "cross-node per GPU" in text
        assert "parameter all-gather (hpZ group)" in text  # the traffic table
        if network == "ib":
            assert "already hides behind compute" in text
        else:
            assert "allow them with --allow-quantized-comm" in text
    text, cfg = _ds("--nodes", "8", "--model", "llama-3.1-70b", "--network", "ethernet",
                    "--allow-quantized-comm")
    zero = cfg["zero_optimization"]
    assert zero["zero_quantized_weights"] is True and zero["zero_quantized_gradients"] is True
    assert "lossy" in text and "cross-node bytes against plain ZeRO-3" in text
    text, cfg = _ds("--nodes", "1", "--model", "llama-3.1-8b")  # one node: never
    assert not any(k.startswith("zero_") for k in cfg["zero_optimization"])
    assert "ZeRO-3" in text and "not weighed: one node" in text


def test_generated_zeropp_configs_pass_deepspeeds_parser():
    """Every way mdtk writes ZeRO++ (ds-config's choice, a forced hpZ, the plan search's
    --emit config) gives a config DeepSpeed's own parser accepts at the cluster's size."""
    from toolkit.planner.emit import deepspeed_json
    from toolkit.planner.report import PlanRequest, plan_layouts

    configs = []
    for network, allow in (("ib", False), ("ethernet", False), ("ethernet", True)):
        req = Request(model=LLAMA_70B, cluster=Cluster(nodes=8, gpus_per_node=8),
                      train=TrainShape(seq_len=4096), allow_quantized_comm=allow)
        configs.append(zero_auto(req, get_device("h100", inter=network_inter(network, 8))).config)
    forced = Request(model=load_model_shape("llama-3.1-8b"), cluster=Cluster(nodes=2),
                     train=TrainShape(seq_len=4096), stage="3", hpz=8, quantized_gradients=True)
    configs.append(generate(forced).config)
    report = plan_layouts(PlanRequest("llama-3.1-70b", nodes=8, network="ethernet",
                                      allow_quantized=True))
    best = report.result.plans[0]
    assert best.candidate.hpz == 8 and best.candidate.qgz
    configs.append(deepspeed_json(LLAMA_70B, report.work, best, report.setting.cluster)[0])
    for cfg in configs:
        zero = cfg["zero_optimization"]
        assert zero.get("zero_hpz_partition_size") == 8
        assert deepspeed_errors(cfg, world_size=64 if cfg is not configs[3] else 16) == []
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        parsed = DeepSpeedZeroConfig(**zero)
        assert parsed.zero_hpz_partition_size == 8
        assert parsed.zero_quantized_gradients == zero.get("zero_quantized_gradients", False)
        if zero.get("zero_quantized_gradients"):  # the only dtype DeepSpeed's qgZ kernel reads
            assert cfg["communication_data_type"] == "fp16", cfg


def test_forced_zeropp_requests_and_the_pipeline_reason():
    model = load_model_shape("llama-3.1-8b")
    two = Cluster(nodes=2)
    with pytest.raises(ConfigError, match="consecutive world ranks"):
        generate(Request(model=model, cluster=two, layout=ParallelLayout(tp=2), hpz=8))
    with pytest.raises(ConfigError, match="only ZeRO-3 uses it"):
        generate(Request(model=model, cluster=two, stage="2", hpz=8))
    with pytest.raises(ConfigError, match="larger than the 8 GPUs"):
        generate(Request(model=model, cluster=two, hpz=16))
    plan = generate(Request(model=model, cluster=two, hpz=8))  # stage auto: stage 3 only
    assert plan.chosen.zero.stage == 3 and plan.config["zero_optimization"][
        "zero_hpz_partition_size"] == 8
    # the bug: ZeRO-2 with pp=2 is a combination DeepSpeed cannot run, not memory
    small = Cluster(nodes=1, gpus_per_node=2, gpu_mem=int(11.77 * GIB))
    with pytest.raises(ConfigError) as e:
        generate(Request(model=model_shape_from_hf(mc.TINY_LLAMA), cluster=small, stage="2",
                         layout=ParallelLayout(pp=2)))
    assert str(e.value).startswith("ZeRO stage 2 with pp=2: DeepSpeed cannot combine ZeRO-2/3")
    assert "nothing fits" not in str(e.value)


# -- the lint ------------------------------------------------------------------------------------

BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
LINT_CASES = [  # (zero block, layout, world, errors' words, warnings' words)
    ({"stage": 2, "zero_hpz_partition_size": 8}, ParallelLayout(), 64,
     ["zero_hpz_partition_size at stage 2 does nothing"], []),
    ({"stage": 1, "zero_quantized_gradients": True}, ParallelLayout(), 64,
     ["zero_quantized_gradients at stage 1 does nothing"], []),
    ({"stage": 3, "zero_hpz_partition_size": 2}, ParallelLayout(tp=2), 64,
     ["tp=2 pp=1", "consecutive world ranks", "2.9%"], []),
    ({"stage": 3, "zero_hpz_partition_size": 16}, ParallelLayout(), 64,
     ["larger than the 8 GPUs of a node"], []),
    ({"stage": 3, "zero_hpz_partition_size": 3}, ParallelLayout(), 64,
     ["does not divide the data-parallel size 64"], ["straddle two nodes"]),
    ({"stage": 3, "zero_hpz_partition_size": 8}, ParallelLayout(), 8, [],
     ["covers the whole data-parallel group"]),
    ({"stage": 3, "mics_shard_size": 8}, ParallelLayout(), 64,
     ["MiCS was removed", "zero_hpz_partition_size = the GPUs per node",
      "MiCS ZeRO-3 sharding has been removed"], []),  # (the second: DeepSpeed's own words)
    ({"stage": 3, "mics_shard_size": 8, "zero_hpz_partition_size": 8}, ParallelLayout(), 64,
     ["MiCS and hpZ do not combine"], []),
    ({"stage": 3, "zero_quantized_gradients": True}, ParallelLayout(), 8, [],
     ["on one node does nothing", "This op had not been implemented on CPU backend"],
     {"communication_data_type": "fp16"}),
    # DeepSpeed's qgZ kernel reads its input as fp16 (the H200 measured noise for bf16)
    ({"stage": 3, "zero_quantized_gradients": True}, ParallelLayout(), 64,
     ["with bf16 gradient communication", '"communication_data_type": "fp16"'], [],
     {"bf16": {"enabled": True}}),
    ({"stage": 3, "zero_quantized_gradients": True}, ParallelLayout(), 64,
     ["with fp32 gradient communication"], []),
]


@pytest.mark.parametrize("case", LINT_CASES, ids=lambda c: json.dumps(c[0])[:60])
def test_lint_knows_zeropp_and_mics(case):
    zero, layout, world, errors, warnings, *extra = case
    report = lint({**BASE, "zero_optimization": zero, **(extra[0] if extra else {})},
                  world_size=world, layout=layout, gpus_per_node=8)
    for words, found in ((errors, report.errors), (warnings, report.warnings)):
        for w in words:
            assert any(w in x for x in found), (w, found)
    assert bool(report.errors) == bool(errors), report.errors


def test_quantized_on_this_machine_is_an_error_when_it_runs_here():
    cfg = {**BASE, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    elsewhere = lint(cfg, world_size=16, gpus_per_node=8)
    here = lint(cfg, world_size=16, gpus_per_node=8, runs_here=True)
    assert not elsewhere.errors and any("quantizer kernels" in w for w in elsewhere.warnings)
    assert any("ValueError: This op had not been implemented on CPU backend" in e
               and "zero_hpz_partition_size alone is exact" in e for e in here.errors)


# -- real engines on CPU gloo ranks --------------------------------------------------------------

@pytest.fixture(scope="module")
def engines_4(rank_pool_4):
    return rank_pool_4.run(zc.engine_checks, 4, 2, timeout=600)


def _predicted_memory(cfg: dict, world: int) -> int:
    z = cfg["zero_optimization"]
    zero = ZeroOptions(stage=3, reduce_bucket_size=z["reduce_bucket_size"],
                       allgather_bucket_size=z["allgather_bucket_size"],
                       prefetch_bucket_size=z["stage3_prefetch_bucket_size"],
                       param_persistence_threshold=z["stage3_param_persistence_threshold"],
                       max_live_parameters=z["stage3_max_live_parameters"],
                       hpz=z.get("zero_hpz_partition_size", 1))
    dtype = "bf16" if "bf16" in cfg else "fp32"
    train = TrainShape(seq_len=mc.SEQ, micro_batch=zc.MICRO, dtype=dtype)
    est = estimate(model_shape_from_hf(mc.TINY_LLAMA), train, ParallelLayout().resolve(world), zero)
    return est.model_states()


def test_hpz_on_cpu_equals_plain_zero3_and_its_memory_is_modelled(engines_4):
    """hpZ 2 on 4 gloo ranks (fp32): the same losses as plain ZeRO-3, and the memory model
    counts its secondary partition: the rank's bytes within 5% (measured: exact)."""
    for r in engines_4:
        plain, hpz = r["plain"], r["hpz"]
        assert hpz["losses"] == pytest.approx(plain["losses"], rel=LOSS_RTOL, abs=0)
        assert hpz["losses"][-1] < hpz["losses"][0]
        params = model_shape_from_hf(mc.TINY_LLAMA).num_params()
        persistent = 5 * mc.TINY_LLAMA["hidden_size"]  # the norms stay whole
        assert hpz["secondary_bytes"] == 4 * (params - persistent) // 2
        assert hpz["held_bytes"] - plain["held_bytes"] == hpz["secondary_bytes"]
        for name, run in (("plain", plain), ("hpz", hpz)):
            cfg = zc.ds_config(4, "fp32", **({"zero_hpz_partition_size": 2}
                                             if name == "hpz" else {}))
            predicted = _predicted_memory(cfg, 4)
            assert abs(run["held_bytes"] - predicted) / predicted < 0.05, name


def test_traffic_model_counts_deepspeeds_collectives(engines_4):
    """The second step's collectives, by group size, against the planner's volumes: plain
    ZeRO-3 gathers every parameter 2m times over the dp group; hpZ once over the dp group and
    2m - 1 times over its group of 2; gradients reduce-scattered m times either way."""
    model = model_shape_from_hf(mc.TINY_LLAMA)
    work = Workload(mc.SEQ, zc.MICRO * zc.GAS * 4, dtype="fp32", flash=False, fused=False)
    net = Network(DEVICES["cpu"], 2)
    for r in engines_4:
        for hpz in (1, 2):
            measured = r["hpz" if hpz > 1 else "plain"]["traffic"]
            cost = step_cost(model, work, Candidate(dp=4, zero=3, hpz=hpz,
                                                    micro_batch=zc.MICRO), net)
            gathered = measured["all_gather_into_tensor@4"][1]
            # the planner gathers the small persistent norms too (640 of 524,928 parameters)
            assert gathered == pytest.approx(cost.volumes["dp_allgather"], rel=2e-3)
            if hpz > 1:
                assert measured["all_gather_into_tensor@2"][1] == pytest.approx(
                    cost.volumes["dp_allgather_hpz"], rel=2e-3)
                assert cost.volumes["dp_allgather_hpz"] == 3 * cost.volumes["dp_allgather"]
            else:
                assert "all_gather_into_tensor@2" not in measured
            assert measured["reduce_scatter_tensor@4"][1] == cost.volumes["dp_reducescatter"]


def test_quantized_comm_refused_on_cpu_with_deepspeeds_reason(engines_4):
    for r in engines_4:
        for key in ("zero_quantized_weights", "zero_quantized_gradients"):
            assert r[key] == "ValueError: This op had not been implemented on CPU backend.", key


# -- mdtk's trainer ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer_4(rank_pool_4, trainer_assets):
    assets, root = trainer_assets
    return rank_pool_4.run(zc.trainer_checks_zeropp, assets, str(root / "zeropp"), timeout=900)


def test_trainer_runs_hpz_at_dp4_equal_to_plain_zero3(trainer_4):
    for r in trainer_4:
        plain, hpz = r["zero3_dp4"], r["zero3_dp4_hpz2"]
        assert hpz["used"]["zero"]["zero_hpz_partition_size"] == 2
        assert hpz["used"]["hpz_group"] == 2 and hpz["used"]["secondary_params"] > 0, hpz["used"]
        assert plain["used"]["hpz_group"] == 1 and plain["used"]["secondary_params"] == 0, \
            plain["used"]
        assert (hpz["dp"], hpz["stage"]) == (4, 3)
        assert hpz["losses"] == pytest.approx(plain["losses"], rel=LOSS_RTOL, abs=0)
        assert hpz["losses"][-1] < hpz["losses"][0] - 0.5
        assert not hpz["left_initialised"]


def test_trainer_refuses_what_cannot_run_here_before_any_engine(trainer_4):
    expected = {
        "refuse_qwz_cpu": ["zero_quantized_weights needs DeepSpeed's quantizer kernels",
                           "This op had not been implemented on CPU backend"],
        "refuse_hpz_tp2": ["tp=2 pp=1", "consecutive world ranks"],
        "refuse_zero2_pp2": ["ZeRO stage 2 with pp=2: DeepSpeed cannot combine ZeRO-2/3"],
    }
    for r in trainer_4:
        got = {x["case"]: x for x in r["refusals"]}
        for name, words in expected.items():
            for w in words:
                assert w in got[name]["error"], (name, got[name]["error"])
            assert "nothing fits" not in got[name]["error"]
            assert not got[name]["ds_config_written"] and not got[name]["left_initialised"]
