"""DeepSpeed config generator and lint: choices, DeepSpeed's parser, HF "auto" keys, presets."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.dsconfig import (
    HF_AUTO_KEYS,
    ConfigError,
    Request,
    deepspeed_errors,
    generate,
    lint,
    preset_configs,
)
from toolkit.dsconfig.lint import HF_ONLY_AUTO_KEYS, _walk
from toolkit.dsconfig.presets import readme, render
from toolkit.memory import GIB, Cluster, ModelShape, TrainShape, load_model_shape
from toolkit.parallel.layout import ParallelLayout

ROOT = Path(__file__).resolve().parent.parent


def request(model="llama-3.1-8b", nodes=1, gpus=8, gpu_mem=80, cpu_mem=1024, **kw) -> Request:
    cluster = Cluster(nodes=nodes, gpus_per_node=gpus, gpu_mem=gpu_mem * GIB,
                      cpu_mem=cpu_mem * GIB, nvme_path=kw.pop("nvme_path", None))
    train = kw.pop("train", TrainShape(seq_len=4096, micro_batch=1, global_batch=64,
                                       recompute="selective"))
    return Request(model=load_model_shape(model), cluster=cluster, train=train, **kw)


def test_auto_picks_least_communication_stage_that_fits_and_explains():
    small = generate(request("llama-3.2-1b"))
    assert small.chosen.zero.stage == 0 and len(small.considered) == 1
    big = generate(request("llama-3.1-8b"))
    stages = [(o.zero.stage, o.fits) for o in big.considered]
    assert stages == [(0, False), (1, True)]
    assert "GPU needs" in big.considered[0].reason
    cfg = big.config
    assert cfg["train_batch_size"] == 64 == cfg["train_micro_batch_size_per_gpu"] * cfg[
        "gradient_accumulation_steps"] * 8
    z = cfg["zero_optimization"]
    assert z["reduce_bucket_size"] == 4096 * 4096 and isinstance(z["reduce_bucket_size"], int)


def test_small_hidden_sizes_get_the_bucket_floor():
    """h*h buckets of a small model would cost ~100 latency-bound collectives a step."""
    from toolkit.dsconfig.generator import MIN_BUCKET, zero_options

    tiny = ModelShape(hidden=256, ffn=704, layers=4, heads=8, kv_heads=4, head_dim=32,
                      vocab=2048)
    z = zero_options(tiny, 2)
    assert z.reduce_bucket_size == z.allgather_bucket_size == MIN_BUCKET == 2048 * 2048
    assert z.prefetch_bucket_size == int(0.9 * 256 * 256)  # stage-3 prefetch keeps h*h
    big = zero_options(load_model_shape("llama-3.1-8b"), 2)
    assert big.reduce_bucket_size == 4096 * 4096


def test_offload_only_when_nothing_fits_on_gpus_and_pin_memory_from_host_ram():
    plan = generate(request("llama-3.1-70b", gpu_mem=80, cpu_mem=4096,
                            train=TrainShape(seq_len=4096, global_batch=64, recompute="full")))
    labels = [o.label for o in plan.considered]
    assert labels[:4] == ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert not any(o.fits for o in plan.considered[:-1])
    z = plan.config["zero_optimization"]
    assert z["offload_optimizer"]["device"] == "cpu" and z["stage"] == 3
    pinned = plan.chosen.estimate.cpu * 8  # ~1051 GiB per node: pinned only if <= half of RAM
    assert z["offload_optimizer"]["pin_memory"] is True and pinned <= 2048 * GIB
    small_host = generate(request("llama-3.1-70b", cpu_mem=2048, train=TrainShape(
        seq_len=4096, global_batch=64, recompute="full")))
    assert small_host.config["zero_optimization"]["offload_optimizer"]["pin_memory"] is False


def test_nothing_fits_is_a_clear_error_listing_every_option():
    with pytest.raises(ConfigError) as e:
        generate(request("llama-3.1-70b", gpus=2, gpu_mem=24, cpu_mem=64, offload="auto"))
    text = str(e.value)
    assert "nothing fits llama-3.1-70b on 2 x 24.00 GiB" in text
    assert "ZeRO-3 + optimizer->cpu + params->cpu" in text and "needs --nvme-path" in text
    with pytest.raises(ConfigError, match="--offload nvme needs --nvme-path"):
        generate(request(offload="nvme"))
    with pytest.raises(ConfigError, match="--hf-trainer with dp=. tp=2"):
        generate(request(layout=ParallelLayout(tp=2), hf_trainer=True))
    with pytest.raises(ConfigError, match="not divisible by tp\\*pp\\*cp"):
        generate(request(gpus=6, layout=ParallelLayout(tp=4)))


def test_nvme_config_has_path_and_top_level_aio():
    plan = generate(request("llama-3.1-8b", stage="3", offload="nvme", nvme_path="/nvme"))
    z = plan.config["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme",
                                      "buffer_count": 4, "fast_init": False}
    assert "aio" in plan.config and "aio" not in z
    assert plan.config["aio"]["intra_op_parallelism"] == 1
    assert lint(plan.config, world_size=8).ok


def test_batch_identity_uses_data_parallel_size():
    plan = generate(request(nodes=2, layout=ParallelLayout(tp=2, pp=2), stage="1",
                            train=TrainShape(seq_len=2048, micro_batch=2, global_batch=64)))
    cfg = plan.config
    assert cfg["gradient_accumulation_steps"] == 64 // (2 * 4)  # dp = 16 / (2*2) = 4
    assert lint(cfg, world_size=16, layout=ParallelLayout(tp=2, pp=2)).ok
    report = lint(cfg, world_size=16)
    assert any("batch identity broken" in e and "data-parallel size 16" in e
               for e in report.errors)


def test_hf_trainer_auto_exactly_where_transformers_fills_it(tmp_path):
    """transformers' HfTrainerDeepSpeedConfig resolves every "auto" we write, and the auto set
    is exactly the keys its code fills (no "auto" left after its two passes) less the two that
    accelerate's plugin does not fill (tests/test_interop_hf_trainer.py runs both for real)."""
    import torch
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    for stage in ("2", "3"):
        cfg = generate(request("llama-3.2-1b", stage=stage, hf_trainer=True)).config
        autos = {p for p, v in _walk(cfg) if v == "auto"}
        both = HF_AUTO_KEYS - HF_ONLY_AUTO_KEYS  # accelerate fills these too
        expected = both if stage == "3" else both - {
            "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold"}
        assert autos == expected
        hf = HfTrainerDeepSpeedConfig(copy.deepcopy(cfg))
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=4, learning_rate=1e-4,
                                 use_cpu=True, report_to=[])
        hf.trainer_config_process(args)
        model = torch.nn.Linear(2, 2)
        model.config = type("C", (), {"hidden_size": 2048})()
        hf.trainer_config_finalize(args, model, num_training_steps=100)
        assert not [p for p, v in _walk(hf.config) if v == "auto"]
        assert hf.config["zero_optimization"]["reduce_bucket_size"] == 2048 * 2048
        # written, not "auto": TrainingArguments' defaults (a mismatch would have raised above)
        assert hf.config["optimizer"]["params"]["betas"] == [args.adam_beta1, args.adam_beta2]
        assert hf.config["optimizer"]["params"]["eps"] == args.adam_epsilon
        assert not deepspeed_errors(hf.config)


LINT_CASES = [
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "offload_param.device=cpu at stage 2"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                              "nvme_path": "/x"}}},
     "silently runs it as CPU offload"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "device=nvme without nvme_path"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "auto"}}},
     'offload_optimizer.device = "auto"'),
    ({"zero_optimization": {"stage": 3, "aio": {"block_size": 1048576}}},
     '"aio" is inside zero_optimization'),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0.9 * 4096 * 4096}},
     "stage3_prefetch_bucket_size=15099494.4 must be an integer"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both true"),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 1}, "batch identity broken"),
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage=5 is not allowed"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     "offload_optimizer.device='gpu' is not allowed: use one of 'none', 'cpu' or 'nvme'"),
    ({"aio": {"thread_count": 2}}, "intra_op_parallelism"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "DeepSpeed's CPU optimizers"),
]


@pytest.mark.parametrize("bad,message", LINT_CASES)
def test_lint_errors_in_plain_words(bad, message):
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
           "gradient_accumulation_steps": 1, **bad}
    report = lint(cfg, world_size=8)
    assert not report.ok
    assert any(message in e for e in report.errors), report.errors
    assert not any("validation error" in e or "pydantic" in e for e in report.errors)


def test_lint_warnings_and_cli_exit_codes(tmp_path):
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
           "gradient_accumulation_steps": 1, "gradient_cliping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "max_grad_norm": 1.0}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    report = lint(cfg, world_size=8)
    assert report.ok
    assert any("did you mean 'gradient_clipping'" in w for w in report.warnings)
    assert any("max_grad_norm" in w for w in report.warnings)
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(cfg))
    bad.write_text(json.dumps({**cfg, "bf16": {"enabled": True}, "fp16": {"enabled": True}}))
    runner = CliRunner()
    ok = runner.invoke(app, ["ds-config", "--check", str(good), "--world-size", "8"])
    assert ok.exit_code == 0 and "OK (2 warnings)" in ok.output
    fail = runner.invoke(app, ["ds-config", "--check", str(bad), "--world-size", "8"])
    assert fail.exit_code == 1 and "both true" in fail.output


def test_cli_generates_and_estimates(tmp_path):
    runner = CliRunner()
    out = tmp_path / "ds.json"
    res = runner.invoke(app, ["ds-config", "--model", "llama-3.1-8b", "--gpu-mem", "80GB",
                              "--global-batch", "64", "--recompute", "selective", "-o", str(out),
                              "--deepspeed-parse"])
    assert res.exit_code == 0, res.output
    assert "DeepSpeed's parser accept" in res.output
    assert "-> ZeRO-1" in res.output and json.loads(out.read_text())["zero_optimization"][
        "stage"] == 1
    res = runner.invoke(app, ["estimate", "--model", "llama-3.1-8b", "--stage", "3", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["zero_stage"] == 3 and data["total_bytes"]["gpu"] > 0
    res = runner.invoke(app, ["estimate", "--model", "nope-7b"])
    assert res.exit_code == 1 and "not a preset" in res.output


def test_presets_in_sync_and_accepted_by_deepspeed():
    configs = preset_configs()
    for name, cfg in configs.items():
        committed = (ROOT / "ds_configs" / f"{name}.json").read_text()
        assert committed == render(cfg), f"ds_configs/{name}.json is stale: run " \
                                         "scripts/gen_ds_presets.py"
        assert lint(cfg, world_size=None if "hf_trainer" in name else 8).ok, name
    from toolkit.dsconfig.presets import preset_plans

    assert (ROOT / "ds_configs" / "README.md").read_text() == readme(preset_plans())


shapes = st.builds(
    lambda h_mult, heads_pow, kv_div, layers, ffn_mult, vocab, experts: ModelShape(
        hidden=64 * h_mult * 2**heads_pow, layers=layers, heads=2**heads_pow * 2,
        kv_heads=max(1, 2**heads_pow * 2 // kv_div), head_dim=32 * h_mult,
        ffn=64 * ffn_mult, vocab=vocab, experts=experts, top_k=min(2, experts),
        moe_ffn=64 * ffn_mult if experts else 0,
        moe_layers=tuple(range(layers)) if experts else ()),
    st.integers(1, 64), st.integers(0, 4), st.sampled_from([1, 2, 4]), st.integers(1, 96),
    st.integers(1, 512), st.integers(100, 300_000), st.sampled_from([0, 0, 8]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=shapes, nodes=st.integers(1, 64), gpus=st.sampled_from([1, 2, 4, 8]),
       gpu_mem=st.sampled_from([16, 24, 40, 80, 141]), cpu_mem=st.sampled_from([64, 512, 2048]),
       tp=st.sampled_from([1, 2, 8]), pp=st.sampled_from([1, 2]), seq=st.sampled_from(
           [512, 2048, 8192]), micro=st.integers(1, 4), gas=st.integers(1, 8),
       nvme=st.booleans(), hf=st.booleans(), recompute=st.sampled_from(["none", "full"]))
def test_property_generator_accepted_by_deepspeed_or_clear_error(
        model, nodes, gpus, gpu_mem, cpu_mem, tp, pp, seq, micro, gas, nvme, hf, recompute):
    layout = ParallelLayout(tp=tp, pp=pp)
    world = nodes * gpus
    dp = world // (tp * pp) if world % (tp * pp) == 0 else 1
    req = Request(model=model, cluster=Cluster(nodes=nodes, gpus_per_node=gpus,
                                               gpu_mem=gpu_mem * GIB, cpu_mem=cpu_mem * GIB,
                                               nvme_path="/nvme" if nvme else None),
                  train=TrainShape(seq_len=seq, micro_batch=micro, global_batch=micro * gas * dp,
                                   recompute=recompute),
                  layout=layout, hf_trainer=hf)
    try:
        plan = generate(req)
    except ConfigError as e:
        assert str(e)  # a message that says what does not fit
        return
    report = lint(plan.config, world_size=None if hf else world, layout=layout)
    assert report.ok, report.errors
