"""The plan search: only plans the memory model accepts, mdtk's rules, ds-config's recompute
choice (the 70B case of issue 12), and the ``mdtk plan`` command (table, JSON, emit, sweep)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.dsconfig import Request, generate, lint
from toolkit.dsconfig.generator import zero_options
from toolkit.memory import GIB, Cluster, ModelShape, TrainShape, estimate, load_model_shape
from toolkit.parallel.layout import LayoutError
from toolkit.planner import DEVICES, Workload, default_global_batch, explain, search
from toolkit.planner.emit import deepspeed_json
from toolkit.planner.search import (
    SearchSpace,
    candidates,
    offload_allowed,
    train_shape,
    zero_allowed,
    zero_for,
)
from toolkit.planner.sweep import marks, sweep_global_batch
from toolkit.planner.zero_auto import zero_auto

runner = CliRunner()


def _assert_fits(model: ModelShape, work: Workload, cluster: Cluster, plans) -> None:
    """Re-estimate each plan from scratch and hold it to ds-config's budget."""
    budget = int(cluster.gpu_mem * 0.9) - 2 * GIB
    host = int(cluster.cpu_mem * 0.9) // cluster.gpus_per_node
    for p in plans:
        c = p.candidate
        est = estimate(model, train_shape(work, c), c.layout(), zero_for(model, c))
        assert est.gpu <= budget, (c.describe(), est.gpu / GIB)
        assert est.cpu <= host, (c.describe(), est.cpu / GIB)
        assert est.gpu == p.mem_per_gpu
        assert c.world_size == cluster.world_size
        assert work.global_batch % (c.micro_batch * c.dp) == 0
        assert zero_allowed(c.zero, c.pp, bool(model.experts))
        assert offload_allowed(c.zero, c.offload)
        assert c.tp <= cluster.gpus_per_node and model.heads % c.tp == 0
        assert c.cp == 1  # context parallelism is only ranked with allow_cp
    times = [p.cost.step for p in plans]
    assert times == sorted(times)


@pytest.mark.parametrize("model, nodes, gpus, device", [
    ("llama-3.2-1b", 1, 8, "h100"), ("llama-3.1-8b", 1, 8, "a100-40gb"),
    ("llama-3.1-70b", 4, 8, "h100"), ("llama-3.1-70b", 1, 8, "h100"),
    ("mixtral-8x7b", 2, 8, "h100"), ("qwen1.5-moe-a2.7b", 1, 4, "l40s"), ("gpt2", 1, 2, "l4"),
])
def test_every_plan_fits_the_memory_model(model, nodes, gpus, device):
    shape = load_model_shape(model)
    dev = DEVICES[device]
    cluster = Cluster(nodes, gpus, int(dev.memory_gib * GIB), 2048 * GIB)
    work = Workload(4096, default_global_batch(4096, cluster.world_size))
    result = search(shape, work, cluster, dev, top=10)
    assert result.plans, result.reasons
    _assert_fits(shape, work, cluster, result.plans)
    if shape.experts:
        assert all(p.candidate.zero in (1, 2) for p in result.plans)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(h=st.sampled_from([512, 1024, 2048]), layers=st.sampled_from([4, 8, 12]),
       kv=st.sampled_from([2, 4, 8]), gpus=st.sampled_from([2, 4, 8]),
       mem=st.sampled_from([8, 16, 24]), seq=st.sampled_from([1024, 4096]))
def test_random_shapes_only_fitting_plans(h, layers, kv, gpus, mem, seq):
    shape = ModelShape(hidden=h, layers=layers, heads=8, kv_heads=kv, head_dim=h // 8,
                       ffn=4 * h, vocab=32000, name="random")
    cluster = Cluster(1, gpus, mem * GIB, 64 * GIB)
    work = Workload(seq, 8 * gpus)
    result = search(shape, work, cluster, DEVICES["a10"], top=6)
    _assert_fits(shape, work, cluster, result.plans)


def test_rules_match_the_trainer_and_the_memory_model():
    """zero_allowed == what the engine's check_supported and the memory model accept."""
    from toolkit.train.loop.engine import EngineError, check_supported

    llama = load_model_shape("llama-3.2-1b")
    for zero in (0, 1, 2, 3):
        for pp in (1, 2):
            for moe in (False, True):
                ok = True
                try:
                    check_supported({"zero_optimization": {"stage": zero},
                                     "gradient_clipping": 1.0}, pp=pp, has_experts=moe)
                except EngineError:
                    ok = False
                try:
                    estimate(llama, TrainShape(seq_len=256, global_batch=8),
                             dataclasses.replace(__import__(
                                 "toolkit.parallel.layout", fromlist=["ParallelLayout"]
                             ).ParallelLayout(pp=pp)).resolve(2), zero_options(llama, zero))
                except LayoutError:
                    ok = False
                assert zero_allowed(zero, pp, moe) == ok, (zero, pp, moe)
    assert offload_allowed(2, "optimizer") and offload_allowed(3, "all")
    assert not offload_allowed(1, "optimizer") and not offload_allowed(2, "all")


def test_candidates_respect_divisibility():
    shape = load_model_shape("llama-3.1-8b")  # 32 heads, 8 kv heads, 32 layers
    work = Workload(4096, 48)
    seen = list(candidates(shape, work, 24, 8))
    assert seen
    for c in seen:
        assert c.world_size == 24 and 8 % c.tp == 0 and 8 % c.tp == 0
        assert 32 % (c.pp * c.vpp) == 0 and 48 % (c.micro_batch * c.dp) == 0
        assert c.vpp == 1 or (c.pp > 1 and (48 // (c.micro_batch * c.dp)) % c.pp == 0)
    assert {c.tp for c in seen} == {1, 2, 4, 8}
    assert all(c.cp == 1 for c in seen)
    with_cp = list(candidates(shape, work, 24, 8, SearchSpace(allow_cp=True)))
    assert {c.cp for c in with_cp} == {1, 2, 4, 8}


def test_issue_70b_ds_config_is_zero3_optimizer_offload_and_recompute():
    req = Request(model=load_model_shape("llama-3.1-70b"), cluster=Cluster(1, 8, 80 * GIB,
                                                                           2048 * GIB),
                  train=TrainShape(seq_len=4096, micro_batch=1))
    plan = zero_auto(req)
    z = plan.config["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in z  # parameter offload also fits, but is slower
    assert plan.chosen.recompute == "full"
    no_offload = [o for o in plan.considered if o.zero.offload_optimizer == "none"]
    assert len(no_offload) == 12 and not any(o.fits for o in no_offload)  # tried first
    assert any("train.recompute: full" in n for n in plan.notes)
    with pytest.raises(Exception, match="nothing fits"):  # what the issue saw before
        generate(dataclasses.replace(req, train=TrainShape(seq_len=4096, micro_batch=1,
                                                           recompute="none"), offload="cpu",
                                     stage="3"))


def test_issue_70b_command_line():
    args = ["ds-config", "--model", "llama-3.1-70b", "--nodes", "1", "--gpus-per-node", "8",
            "--gpu-mem", "80GB", "--cpu-mem", "2TB", "--stage", "auto", "--offload", "auto",
            "--seq-len", "4096", "--micro-batch", "1"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "-> ZeRO-3 + optimizer->cpu + recompute full" in res.output
    cfg = json.loads(res.stdout[res.stdout.index("{"):])
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    hf = runner.invoke(app, args + ["--hf-trainer"])
    assert hf.exit_code == 0, hf.output
    assert "gradient checkpointing" in hf.output and "gradient_checkpointing=True" in hf.output
    assert "recompute selective" not in hf.output  # HF has no selective mode
    fixed = runner.invoke(app, args + ["--recompute", "none"])  # the old behaviour, kept
    assert fixed.exit_code == 1 and "nothing fits" in fixed.output


def test_recompute_is_tried_before_offload():
    req = Request(model=load_model_shape("llama-3.1-8b"), cluster=Cluster(1, 2, 80 * GIB,
                                                                          1024 * GIB),
                  train=TrainShape(seq_len=4096, micro_batch=1))
    plan = zero_auto(req)
    assert plan.chosen.label == "ZeRO-3 + recompute full"
    assert "offload_optimizer" not in plan.config["zero_optimization"]
    fixed = generate(req)  # recompute fixed at none: only offload fits
    assert fixed.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_plan_json_fields_and_ranking():
    res = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--nodes", "2", "--top", "3",
                              "--tokens", "1T", "--price-per-gpu-hour", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["global_batch"] == 256 and len(out["plans"]) == 3
    for p in out["plans"]:
        for key in ("tp", "pp", "cp", "ep", "dp", "zero_stage", "offload", "recompute",
                    "micro_batch", "tokens_per_s_per_gpu", "mfu", "step_time_s",
                    "mem_per_gpu_gib", "hours_for_tokens", "cost_for_tokens"):
            assert key in p, key
        assert p["tp"] * p["pp"] * p["cp"] * p["dp"] == 16
        assert p["mem_per_gpu_gib"] <= 80 * 0.9 - 2
        tokens_per_s = p["tokens_per_s_per_gpu"] * 16
        assert p["hours_for_tokens"] == pytest.approx(1e12 / tokens_per_s / 3600)
        assert p["cost_for_tokens"] == pytest.approx(p["hours_for_tokens"] * 16 * 2)
        assert p["step_time_s"] == pytest.approx(256 * 4096 / tokens_per_s)
    assert [p["step_time_s"] for p in out["plans"]] == sorted(p["step_time_s"]
                                                              for p in out["plans"])
    table = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--top", "2"])
    assert table.exit_code == 0, table.output
    assert "#1 step: compute" in table.output and "#1 over #2:" in table.output


def test_explain_names_the_difference():
    shape = load_model_shape("llama-3.1-70b")
    cluster = Cluster(2, 8, 80 * GIB, 2048 * GIB)
    result = search(shape, Workload(4096, 256), cluster, DEVICES["h100"], top=3)
    best, other = result.plans[0], result.plans[2]
    text = explain(best, other)
    pct = other.cost.step / best.cost.step - 1
    assert text.startswith(f"{other.candidate.describe()} is {pct:.1%} slower")


def test_nothing_fits_says_so():
    res = runner.invoke(app, ["plan", "--model", "llama-3.1-70b", "--gpus-per-node", "2",
                              "--gpu", "l4", "--cpu-mem", "64GB"])
    assert res.exit_code == 1 and "no plan of llama-3.1-70b fits" in res.output
    res = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpu", "tpu9"])
    assert res.exit_code == 1 and "unknown device 'tpu9'" in res.output


def test_sweep_marks_fastest_and_cheapest(tmp_path):
    assert sweep_global_batch(4096, [8, 16, 24]) % 48 == 0
    png = tmp_path / "sweep.png"
    res = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--sweep-gpus", "8,16,32",
                              "--tokens", "100B", "--price-per-gpu-hour", "3", "--json",
                              "--plot", str(png)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    rows = {r["gpus"]: r for r in out["rows"]}
    assert set(rows) == {8, 16, 32} and out["global_batch"] % 32 == 0
    for n, r in rows.items():
        assert r["cost"] == pytest.approx(r["hours"] * n * 3)
    assert out["fastest_gpus"] == min(rows, key=lambda n: rows[n]["hours"])
    assert out["cheapest_gpus"] == min(rows, key=lambda n: rows[n]["cost"])
    assert rows[32]["hours"] < rows[8]["hours"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # matplotlib is a dependency
    bad = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--sweep-gpus", "8,12",
                              "--tokens", "1B"])
    assert bad.exit_code == 1 and "12 GPUs is not a whole number of 8-GPU nodes" in bad.output


def test_sweep_figure_marks_points():
    from toolkit.planner.sweep import figure, sweep

    shape = load_model_shape("llama-3.2-1b")
    rows = sweep(shape, Workload(2048, 512), [8, 16], Cluster(1, 8, 80 * GIB, 1024 * GIB),
                 DEVICES["h100"], 1e10)
    fig = figure(rows, "t", priced=False)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "fastest" in texts and "cheapest" in texts
    assert marks(rows) == (16, 8) or marks(rows)[0] is not None


def test_emit_writes_a_config_the_trainer_accepts(tmp_path):
    from toolkit.train.config import load_config

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    out = tmp_path / "plan"
    res = runner.invoke(app, ["plan", "--model", "llama-3.2-1b", "--gpus-per-node", "8",
                              "--tokens", "1B", "--emit", str(out), "--data", str(data),
                              "--tokenizer", str(tmp_path / "tok")])
    assert res.exit_code == 0, res.output
    raw = yaml.safe_load((out / "train.yaml").read_text())
    ds = json.loads((out / "ds_config.json").read_text())
    cfg = load_config(out / "train.yaml")
    assert cfg.deepspeed.config == str((out / "ds_config.json").resolve())
    assert cfg.model.config == str((out / "model_config.json").resolve())
    assert ds["zero_optimization"]["stage"] == raw["deepspeed"]["zero_stage"]
    assert raw["train"]["steps"] == -(-10**9 // (raw["train"]["global_batch"] * 4096))
    layout = cfg.parallel.layout()
    assert lint(ds, world_size=8, layout=layout).ok
    assert f"mdtk launch -n 8 -- train {out / 'train.yaml'}" in res.output
    missing = runner.invoke(app, ["plan", "--model", "llama-3.2-1b", "--emit", str(out)])
    assert missing.exit_code == 1 and "--tokenizer" in missing.output
    no_data = runner.invoke(app, ["plan", "--model", "llama-3.2-1b", "--emit", str(out),
                                  "--tokenizer", "t"])
    assert no_data.exit_code == 1 and "--emit needs training data" in no_data.output


def test_context_parallel_plans_are_runnable_and_emitted():
    shape = load_model_shape("llama-3.1-8b")
    cluster = Cluster(1, 8, 80 * GIB, 1024 * GIB)
    work = Workload(32768, 8)
    result = search(shape, work, cluster, DEVICES["h100"], top=20,
                    space=SearchSpace(allow_cp=True))
    cp_plans = [p for p in result.plans if p.candidate.cp > 1]
    assert cp_plans and all(p.runnable and not p.note for p in result.plans)
    config, _ = deepspeed_json(shape, work, cp_plans[0], cluster)
    c = cp_plans[0].candidate  # DeepSpeed's data-parallel group is dp x cp
    assert config["train_batch_size"] == (config["train_micro_batch_size_per_gpu"]
                                          * config["gradient_accumulation_steps"] * c.dp * c.cp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = search(shape, work, cluster, DEVICES["h100"], top=20)
    assert all(p.candidate.cp == 1 for p in default.plans)


def test_context_parallel_plans_only_for_models_it_runs():
    """With allow_cp, cp > 1 is searched for DeepSeek-V3 (multi-latent attention runs in mdtk's
    CP attention) but never for GPT-OSS (sinks, sliding windows): the same reason the trainer's
    layout check gives (``Family.cp_refusal``); a fixed cp=2 for it is one PlanError."""
    from dist_checks.adapter_checks import tiny_open_moe_configs

    from toolkit.memory import model_shape_from_hf
    from toolkit.planner.search import PlanError

    work = Workload(4096, 64)
    dsv3 = load_model_shape("deepseek-v3")
    assert dsv3.cp_refusal == ""
    assert {c.cp for c in candidates(dsv3, work, 64, 8, SearchSpace(allow_cp=True))} > {1}
    oss = model_shape_from_hf({**tiny_open_moe_configs()["gpt_oss"].to_dict(),
                               "architectures": ["GptOssForCausalLM"]}, name="gpt-oss")
    assert "sinks" in oss.cp_refusal
    assert {c.cp for c in candidates(oss, work, 16, 8, SearchSpace(allow_cp=True))} == {1}
    with pytest.raises(PlanError, match=r"cp=2: .*sinks.*\(gpt-oss\).*set it to 1"):
        search(oss, work, Cluster(2, 8, 80 * GIB, 1024 * GIB), DEVICES["h100"],
               space=SearchSpace(allow_cp=True, fixed=(("cp", 2),)))
