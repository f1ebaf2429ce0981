"""The trainer's DeepSpeed config from the dsconfig package: the generator's choice or the user's
JSON, the trainer's keys set, and the result linted (the same lint as ``mdtk ds-config``)."""

from __future__ import annotations

import json

import pytest

from toolkit.dsconfig import ConfigError, Request, generate, lint
from toolkit.dsconfig.training import QUIET_STEPS, TrainerKeys, trainer_config, with_trainer_keys
from toolkit.memory import GIB, Cluster, TrainShape, load_model_shape
from toolkit.parallel.layout import ParallelLayout

LAYOUT = ParallelLayout(tp=2).resolve(8)  # dp = 4
KEYS = TrainerKeys(micro_batch=2, global_batch=32, grad_accum=4, clip_grad=0.5, lr=2e-4,
                   weight_decay=0.05, betas=(0.9, 0.98), eps=1e-6, precision="bf16")


def _request(**kw) -> Request:
    return Request(model=load_model_shape("llama-3.2-1b"),
                   cluster=Cluster(nodes=1, gpus_per_node=8, gpu_mem=80 * GIB, cpu_mem=1024 * GIB),
                   train=TrainShape(seq_len=2048, micro_batch=2, global_batch=32),
                   layout=ParallelLayout(tp=2), lr=2e-4, **kw)


def test_trainer_keys_replace_what_the_trainer_owns_without_touching_the_input():
    base = {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR"}, "steps_per_print": 5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1.0, "torch_adam": True}},
            "fp16": {"enabled": True, "loss_scale": 0}, "zero_optimization": {"stage": 2}}
    before = json.dumps(base)
    out = with_trainer_keys(base, KEYS)
    assert json.dumps(base) == before  # a copy: the caller's config is unchanged
    assert "scheduler" not in out  # the trainer sets the LR of every step itself
    assert (out["train_batch_size"], out["train_micro_batch_size_per_gpu"],
            out["gradient_accumulation_steps"]) == (32, 2, 4)
    assert out["gradient_clipping"] == 0.5 and out["steps_per_print"] == QUIET_STEPS
    assert out["optimizer"] == {"type": "AdamW", "params": {
        "lr": 2e-4, "torch_adam": True, "weight_decay": 0.05, "betas": [0.9, 0.98], "eps": 1e-6}}
    assert out["bf16"] == {"enabled": True} and out["fp16"] == {"enabled": False}
    assert out["zero_optimization"] == {"stage": 2}
    assert with_trainer_keys({}, KEYS)["optimizer"]["type"] == "AdamW"


def test_generated_config_gets_the_trainer_keys_and_passes_the_lint():
    config, notes = trainer_config(_request(), KEYS, LAYOUT)
    plan = generate(_request())
    assert notes[0] == f"chose {plan.chosen.label}: {plan.chosen.reason}"
    assert config == with_trainer_keys(plan.config, KEYS)
    assert lint(config, world_size=8, layout=LAYOUT).ok


def test_user_json_is_linted_before_and_after_the_trainer_keys(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "wall_clock_breakdwn": True,
                                "zero_optimization": {"stage": 1}}))
    config, notes = trainer_config(good, KEYS, LAYOUT)
    assert notes[0] == f"user DeepSpeed config {good}"
    assert any("wall_clock_breakdwn" in n for n in notes)  # the lint's warnings are kept
    assert config["zero_optimization"] == {"stage": 1} and config["train_batch_size"] == 32

    bad = tmp_path / "bad.json"  # DeepSpeed accepts it, but offload_param does nothing at stage 2
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 2, "offload_param": {"device": "cpu"}}}))
    with pytest.raises(ConfigError, match="offload_param.device=cpu at stage 2"):
        trainer_config(bad, KEYS, LAYOUT)
    broken = tmp_path / "broken.json"  # the user's own batch keys are checked too
    broken.write_text(json.dumps({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2,
                                  "gradient_accumulation_steps": 4}))
    with pytest.raises(ConfigError, match="batch identity broken: train_batch_size=30"):
        trainer_config(broken, KEYS, LAYOUT)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="a DeepSpeed config is a JSON object"):
        trainer_config(tmp_path / "list.json", KEYS, LAYOUT)


def test_the_final_config_is_linted_with_the_trainer_keys(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    wrong = TrainerKeys(**{**KEYS.__dict__, "global_batch": 30})  # 30 != 2 x 4 x dp 4
    with pytest.raises(ConfigError, match="with the keys the trainer sets .*batch identity "
                                          "broken: train_batch_size=30"):
        trainer_config(good, wrong, LAYOUT)
    with pytest.raises(ConfigError, match="with the keys the trainer sets"):
        trainer_config(_request(), wrong, LAYOUT)


def rank_lint_errors(config: dict) -> list[str]:
    return lint(config, world_size=2).errors


def test_lint_inside_a_torch_process_group(rank_pool_2):
    # the trainer lints on its ranks, before DeepSpeed's own backend exists (DeepSpeed then
    # checks the batch keys against a world of 1, not torch's 2)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert rank_pool_2.run(rank_lint_errors, config) == [[], []]
    broken = {**config, "train_batch_size": 6}
    for errors in rank_pool_2.run(rank_lint_errors, broken):
        assert any("batch identity broken: train_batch_size=6" in e for e in errors), errors
