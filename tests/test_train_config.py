"""The training YAML schema: typed overrides, up-front errors, derived gradient accumulation."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit import bundled
from toolkit.train.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    load_config,
    parse_override,
    plan,
    total_steps,
)

MINIMAL = {"output_dir": "runs/x", "model": {"path": "some/model"},
           "data": {"sources": ["examples/data/sft.jsonl"]}, "train": {"steps": 10}}


def _cfg(*overrides: str) -> TrainConfig:
    from toolkit.train.config import apply_overrides

    return config_from_dict(apply_overrides(MINIMAL, overrides))


def test_example_configs_load_and_plan():
    cfg = load_config(bundled.PRETRAIN_EXAMPLE)
    assert cfg.parallel.tp == 2 and cfg.data.mode == "pretrain"
    assert cfg.optim.lr == pytest.approx(3e-3) and cfg.optim.betas == (0.9, 0.95)
    p = plan(cfg, 4)  # tp=2 on 4 ranks -> dp=2; 16 / (4 * 2) = 2 micro-batches per step
    assert (p.dp, p.global_batch, p.grad_accum) == (2, 16, 2)
    assert plan(cfg, 2).grad_accum == 4
    sft = load_config(bundled.SFT_EXAMPLE)
    assert sft.data.mode == "sft" and sft.train.precision == "fp32"
    assert plan(sft, 2).grad_accum == 2
    assert sft.checkpoint_dir == Path("build/demo/sft_tiny/checkpoints")


def test_bundled_names_resolve_to_files_shipped_in_the_package():
    root = Path(bundled.__file__).parent
    cfg = load_config(bundled.PRETRAIN_EXAMPLE, ["data.validation_sources=[bundled:examples/"
                                                 "data/sft.jsonl]"])
    assert cfg.model.config == str(root / "examples" / "tiny_llama_config.json")
    assert cfg.data.sources == [str(root / "examples" / "data" / "pretrain.jsonl")]
    assert cfg.data.validation_sources == [str(root / "examples" / "data" / "sft.jsonl")]
    assert cfg.model.tokenizer == "build/demo/tokenizer"  # other values stay as written
    assert all(Path(p).is_file() for p in (cfg.model.config, *cfg.data.sources))
    assert bundled.shipped() == [
        "bundled:examples/data/dpo.jsonl", "bundled:examples/data/dpo_text.jsonl",
        "bundled:examples/data/grpo.jsonl", "bundled:examples/data/kto.jsonl",
        "bundled:examples/data/pretrain.jsonl", "bundled:examples/data/sft.jsonl",
        "bundled:examples/distill_tiny.yaml",
        "bundled:examples/dpo_tiny.yaml", "bundled:examples/eval/arithmetic.jsonl",
        "bundled:examples/eval/data.py", "bundled:examples/eval/mdtk_arithmetic.yaml",
        "bundled:examples/eval/mdtk_sentences.yaml", "bundled:examples/eval/prompts.jsonl",
        "bundled:examples/eval/sentences.jsonl", "bundled:examples/grpo_tiny.yaml",
        "bundled:examples/kto_tiny.yaml", "bundled:examples/lora_tiny.yaml",
        "bundled:examples/orpo_tiny.yaml", "bundled:examples/pretrain_tiny.yaml",
        "bundled:examples/reward_tiny.yaml",
        "bundled:examples/sft_tiny.yaml", "bundled:examples/tiny_llama_config.json"]
    with pytest.raises(ConfigError, match=r"data.sources: bundled:examples/nope.jsonl: mdtk "
                                          r"ships no such file; bundled files: .*sft.jsonl"):
        _cfg("data.sources=[bundled:examples/nope.jsonl]")
    with pytest.raises(ConfigError, match=r"bundled:../pyproject.toml: mdtk ships no such"):
        _cfg("model.path=bundled:../pyproject.toml")
    with pytest.raises(ConfigError, match="bundled:examples/sft.yaml: mdtk ships no such file"):
        load_config("bundled:examples/sft.yaml")


def test_overrides_are_typed_by_the_schema():
    cfg = _cfg("optim.lr=3e-4", "train.steps=1e3", "parallel.tp=2",
               "parallel.sequence_parallel=true", "optim.betas=[0.8, 0.99]",
               "parallel.vpp=null", "deepspeed.zero_stage=3", "checkpoint.resume=none",
               "data.sources=[a.jsonl, b.parquet]", "train.eval_batches=~", "output_dir=runs/y")
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)  # YAML 1.1 says "3e-4" str
    assert cfg.train.steps == 1000 and isinstance(cfg.train.steps, int)
    assert cfg.parallel.sequence_parallel is True and cfg.parallel.vpp is None
    assert cfg.optim.betas == (0.8, 0.99)
    assert cfg.deepspeed.zero_stage == 3 and isinstance(cfg.deepspeed.zero_stage, int)
    assert cfg.checkpoint.resume == "none"  # a string choice, not null
    assert cfg.data.sources == ["a.jsonl", "b.parquet"]
    assert cfg.output_dir == "runs/y" and cfg.train.eval_batches is None
    assert _cfg("deepspeed.zero_stage=auto").deepspeed.zero_stage == "auto"
    assert parse_override("data.sources=one.jsonl") == (["data", "sources"], ["one.jsonl"])
    # later overrides win
    assert _cfg("train.seed=1", "train.seed=7").train.seed == 7


@pytest.mark.parametrize("override, words", [
    ("train.micro_bach=2", ["unknown key 'train.micro_bach'", "Did you mean 'micro_batch'"]),
    ("paralel.tp=2", ["unknown key 'paralel'", "Did you mean 'parallel'"]),
    ("train.precision=fp8", ["train.precision='fp8'", "bf16, fp16, fp32"]),
    ("optim.decay=exp", ["optim.decay='exp'", "cosine, linear, constant"]),
    ("deepspeed.offload=gpu", ["deepspeed.offload='gpu'", "none, cpu, nvme"]),
    ("train.recompute=some", ["train.recompute", "none, selective, full"]),
    ("train.steps=abc", ["train.steps='abc'", "integer"]),
    ("train.steps=2.5", ["train.steps=2.5", "integer"]),
    ("parallel.tp=0", ["parallel.tp=0", ">= 1"]),
    ("parallel.sequence_parallel=maybe", ["parallel.sequence_parallel", "true or false"]),
    ("optim.betas=[0.9]", ["optim.betas", "2 values"]),
    ("train", ["key.path=value"]),
    ("train=3", ["names the section 'train'"]),
    ("train.steps.x=3", ["'train.steps' is a value"]),
])
def test_bad_override_names_key_and_allowed_values(override, words):
    with pytest.raises(ConfigError) as e:
        _cfg(override)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("overrides, words", [
    (["parallel.sequence_parallel=true"], ["parallel:", "sequence_parallel", "tp >= 2"]),
    (["parallel.vpp=2"], ["vpp=2", "pp >= 2"]),
    (["train.epochs=2"], ["exactly one of train.steps and train.epochs"]),
    (["deepspeed.offload=nvme"], ["deepspeed.nvme_path"]),
    (["deepspeed.offload=cpu", "deepspeed.zero_stage=0"], ["needs ZeRO"]),
    (["deepspeed.config=/no/such.json"], ["deepspeed.config='/no/such.json'", "no such file"]),
    (["optim.min_lr=1", "optim.lr=0.1"], ["optim.min_lr=1.0", "larger than optim.lr=0.1"]),
    (["optim.warmup_steps=20"], ["optim.warmup_steps=20 exceeds train.steps=10"]),
    (["train.global_batch=10", "train.micro_batch=4"], ["global_batch=10", "micro_batch=4"]),
    (["data.sources=[]"], ["data.sources is empty"]),
    (["data.validation_split=1.5"], ["data.validation_split=1.5", "[0, 1)"]),
    (["model.config=cfg.json"], ["exactly one of model.path", "model.config"]),
    (["checkpoint.resume=/no/ckpt"], ["checkpoint.resume='/no/ckpt'"]),
    (["output_dir=null"], ["output_dir is required"]),
    (["parallel.tp=2", "parallel.etp=1", "parallel.ep=2"],
     ["parallel.etp=1 with tp=2 and ep=2", "etp=1 with ep=1"]),
    (["parallel.tp=4", "parallel.etp=2"], ["parallel.etp=2 with tp=4", "Set parallel.etp to tp"]),
])
def test_cross_key_errors(overrides, words):
    with pytest.raises(ConfigError) as e:
        _cfg(*overrides)
    for w in words:
        assert w in str(e.value)


def test_unknown_yaml_key_and_bad_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("output_dir: x\nmodel: {path: m}\ndata: {sources: [a]}\n"
                   "train: {steps: 1}\noptim: {learning_rat: 0.1}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'optim.learning_rat' in section 'optim'"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"does not exist \(the examples that ship with mdtk: "
                                          r"bundled:examples/distill_tiny.yaml, bundled:examples/"
                                          r"dpo_tiny.yaml, bundled:examples/grpo_tiny.yaml, "
                                          r"bundled:examples/kto_tiny.yaml, "
                                          r"bundled:examples/lora_tiny.yaml, bundled:examples/"
                                          r"orpo_tiny.yaml, bundled:examples/pretrain_tiny.yaml, "
                                          r"bundled:examples/reward_tiny.yaml, bundled:"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


def test_plan_global_batch_not_divisible_suggests_fix():
    cfg = _cfg("train.global_batch=12", "train.micro_batch=2", "parallel.tp=2")
    assert plan(cfg, 4).grad_accum == 3  # dp=2: 12 / (2 * 2)
    with pytest.raises(ConfigError) as e:
        plan(cfg, 8)  # dp=4: 12 / (2 * 4) is not whole
    msg = str(e.value)
    assert "global_batch=12" in msg and "2 * 4 = 8" in msg and "e.g. 8, 16" in msg
    with pytest.raises(ConfigError, match="not divisible by tp"):
        plan(cfg, 3)
    assert plan(_cfg("train.micro_batch=3"), 2).global_batch == 6  # default: micro * dp


def test_round_trip_and_epochs():
    cfg = _cfg("optim.betas=[0.8, 0.9]", "parallel.tp=2")
    again = config_from_dict(cfg.to_dict())
    assert again == cfg
    ep = _cfg("train.steps=null", "train.epochs=1.5")
    assert total_steps(ep, num_train_samples=100, global_batch=8) == 19  # ceil(150 / 8)
    assert total_steps(cfg, num_train_samples=100, global_batch=8) == 10
