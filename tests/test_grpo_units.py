"""GRPO without ranks: TRL's config names and defaults, the advantages against TRL's own
``nanstd`` and formula, the rows the trainer builds from a rollout, and one clear error for each
bad input before any model or engine is built (a reward function that cannot be imported or
returns the wrong number of rewards, num_generations that does not divide the batch, ragged
recorded groups, a prompt that leaves no room for max_completion_length). The trainer runs are
tests/test_trainer_grpo.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from toolkit.errors import ConfigError, UserError
from toolkit.train.config import config_from_dict
from toolkit.train.data import DataError

PROMPTS = "bundled:examples/data/grpo.jsonl"


def _config(models, tmp_path, **sections):
    raw = {"output_dir": str(tmp_path / "out"),
           "model": {"path": models["dense"], "tokenizer": models["tokenizer"]},
           "data": {"mode": "grpo", "sources": [PROMPTS]},
           "grpo": {"num_generations": 4, "max_completion_length": 8,
                    "rewards": [{"function": "mdtk:format_regex", "args": {"pattern": "1"}}]},
           "train": {"steps": 1, "seq_len": 32, "global_batch": 8, "micro_batch": 4}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return config_from_dict(raw)


def test_trls_names_and_defaults():
    from trl import GRPOConfig

    from toolkit.train.config.schema import GrpoSection

    trl = GRPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False)
    mine = GrpoSection()
    for name in ("num_generations", "max_completion_length", "temperature", "top_p",
                 "loss_type", "importance_sampling_level", "beta", "epsilon", "epsilon_high",
                 "num_iterations", "scale_rewards", "mask_truncated_completions",
                 "use_bias_correction_kl"):
        assert getattr(mine, name) == getattr(trl, name), name


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_formula(scale):
    """TRL's sum_then_normalize (its nanstd, 1e-4, unscored completions NaN then 0) on rewards
    with a tied group and an unscored completion."""
    from trl.trainer.utils import nanstd

    from toolkit.train.objectives.grpo.rewards import advantages

    g = torch.Generator().manual_seed(0)
    per_func = torch.randn(12, 2, generator=g)
    per_func[4:8, :] = 0.5  # a group of equal rewards
    per_func[9, :] = float("nan")  # every function left it unscored
    per_func[10, 1] = float("nan")
    weights = torch.tensor([1.0, 0.3])
    rewards = (per_func * weights).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = float("nan")
    mean = torch.nanmean(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    std = (nanstd(rewards).expand_as(rewards) if scale == "batch"
           else nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4))
    theirs = rewards - mean
    if scale != "none":
        theirs = theirs / (std + 1e-4)
    theirs = torch.nan_to_num(theirs, nan=0.0)
    mine, metrics = advantages(per_func, [1.0, 0.3], 4, scale)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert metrics["frac_reward_zero_std"] == (0.0 if scale == "batch" else pytest.approx(1 / 3))
    assert metrics["reward"] == pytest.approx(float(torch.nanmean(rewards)))


def test_rows_mask_the_completion_tokens_only():
    """prompt + completion in one row: labels shifted by one, the loss on the completion's
    tokens (its EOS included; none of a truncated one when asked), the engine's log-probs at
    the completion's label positions."""
    from toolkit.train.data.grpo import PromptRow
    from toolkit.train.objectives.grpo.objective import Rows, micro_batch
    from toolkit.train.objectives.grpo.rollouts import Rollout

    p = PromptRow("q", (7, 8, 9))
    rollout = Rollout([p, p], [(4, 5, 0), (6, 6)], torch.zeros(2, 1), [3, 2], [False, True],
                      [[-0.1, -0.2, -0.3], [-0.4, -0.5]])
    b = micro_batch(rollout, [0, 1], torch.tensor([1.0, -1.0]), torch.zeros(3),
                    Rows(seq_len=8, pad_id=1, mask_truncated=True))
    assert b["tokens"][0].tolist() == [7, 8, 9, 4, 5, 1, 1, 1]
    assert b["labels"][0, :5].tolist() == [8, 9, 4, 5, 0]
    assert b["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert b["loss_mask"][1].sum() == 0  # truncated, masked
    assert b["sampling_logps"][0, 2:5].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert b["advantages"].tolist() == [1.0, -1.0]


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_bad.py").write_text(
        "def short(prompts, completions, completion_ids, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_bad"
    sys.modules.pop("my_rewards_bad", None)


def test_a_reward_function_returning_the_wrong_length_is_refused_before_any_model(
        trainer_models, tmp_path, reward_module):
    """objective_data (the trainer's first step, before the model) probes each function."""
    from toolkit.train.objectives.grpo.rewards import RewardError
    from toolkit.train.objectives.registry import objective_data

    cfg = _config(trainer_models, tmp_path,
                  grpo={"rewards": [{"function": f"{reward_module}:short"}]})
    with pytest.raises(RewardError) as e:
        objective_data(cfg)
    assert "'short' returned 1 rewards for 2 completions" in str(e.value)
    assert not (tmp_path / "out").exists()


def _rollouts(tmp_path, rows) -> str:
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("case,sections,words", [
    ("import", {"grpo": {"rewards": [{"function": "no_such_module_x:f"}]}},
     ["no_such_module_x:f", "cannot be imported"]),
    ("batch", {"train": {"global_batch": 6, "micro_batch": 2}},
     ["train.global_batch=6", "multiple of grpo.num_generations=4"]),
    ("other_mode", {"data": {"mode": "sft"}, "grpo": {"beta": 0.1, "rewards": []}},
     ["applies to data.mode=grpo; got data.mode=sft"]),
    ("vllm_memory", {"grpo": {"engine": "vllm", "vllm_gpu_memory_utilization": 1.5}},
     ["grpo.vllm_gpu_memory_utilization=1.5", "(0, 1]"]),
    ("cp", {"parallel": {"cp": 2}}, ["parallel.cp=2", "set parallel.cp=1"]),
    ("cispo", {"grpo": {"loss_type": "cispo"}}, ["loss_type=cispo", "epsilon_high"]),
    ("no_rewards", {"grpo": {"rewards": []}}, ["needs grpo.rewards"]),
    ("greedy", {"grpo": {"temperature": 0.0}}, ["grpo.temperature=0"]),
    ("is_bounds", {"grpo": {"vllm_importance_sampling_clip_min": 2.0,
                            "vllm_importance_sampling_clip_max": 1.0}},
     ["vllm_importance_sampling_clip_min=2.0 is above", "clip_max=1.0"]),
    ("is_unbounded", {"grpo": {"vllm_importance_sampling_mode": "token_truncate",
                               "vllm_importance_sampling_clip_max": None}},
     ["vllm_importance_sampling_mode=token_truncate needs"]),
])
def test_bad_settings_are_refused(trainer_models, tmp_path, case, sections, words):
    with pytest.raises(ConfigError) as e:
        _config(trainer_models, tmp_path, **sections)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_vllm_with_recorded_rollouts_is_refused(trainer_models, tmp_path):
    rows = [{"prompt": "a", "completion_ids": [3, 4], "reward": 1.0}] * 4
    with pytest.raises(ConfigError) as e:
        _config(trainer_models, tmp_path, data={"sources": []},
                grpo={"rewards": [], "engine": "vllm", "rollouts": _rollouts(tmp_path, rows)})
    assert "grpo.engine=vllm samples completions, grpo.rollouts replays" in str(e.value)


def test_vllm_tensor_parallel_size_is_checked_against_the_run():
    """grpo.vllm_tensor_parallel_size must divide the ranks (each T consecutive ranks run one
    engine) and the model's attention heads (vLLM splits them): one error each, naming the
    setting, checked before the engine is built."""
    from toolkit.infer.vllm_engine import VllmError, check_tensor_parallel

    check_tensor_parallel(2, 4, 8)
    check_tensor_parallel(1, 3, 6)
    with pytest.raises(VllmError, match=r"vllm_tensor_parallel_size=2 must divide the number "
                                        r"of ranks \(3\)"):
        check_tensor_parallel(2, 3, 8)
    with pytest.raises(VllmError, match=r"vllm_tensor_parallel_size=4 must divide the model's "
                                        r"6 attention heads"):
        check_tensor_parallel(4, 4, 6)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_not_installed_is_one_error_naming_the_install(trainer_models, tmp_path):
    with pytest.raises(ConfigError) as e:
        _config(trainer_models, tmp_path, grpo={"engine": "vllm"})
    for words in ("grpo.engine=vllm", "vllm package is not installed", "make test-vllm",
                  "grpo.engine=megatron"):
        assert words in str(e.value), str(e.value)


def _data(cfg):
    from toolkit.train.objectives.registry import objective_data

    return objective_data(cfg)


def test_ragged_groups_are_refused_naming_the_line(trainer_models, tmp_path):
    rows = [{"prompt": "a", "completion_ids": [3, 4], "reward": 1.0}] * 4 + \
           [{"prompt": "b", "completion_ids": [3], "reward": 0.0}] * 3
    cfg = _config(trainer_models, tmp_path, data={"sources": []},
                  grpo={"rewards": [], "rollouts": _rollouts(tmp_path, rows)})
    with pytest.raises(DataError) as e:
        _data(cfg)
    assert "rollouts.jsonl:5" in str(e.value) and "has 3 rollouts" in str(e.value)


@pytest.mark.parametrize("row,words", [
    ({"prompt": "a", "reward": 1.0}, ["rollouts.jsonl:1", "completion_ids"]),
    ({"prompt": "a", "completion_ids": [3], "reward": "high"}, ["numeric 'reward'"]),
    ({"prompt": "a", "completion_ids": [3, 4], "reward": 1.0, "logprobs": [-0.5]},
     ["rollouts.jsonl:1", "'logprobs' must be a list of 2 numbers"]),
    ({"completion_ids": [3], "reward": 1.0}, ["has no 'prompt'"]),
])
def test_bad_rollout_rows_are_refused(trainer_models, tmp_path, row, words):
    cfg = _config(trainer_models, tmp_path, data={"sources": []},
                  grpo={"rewards": [], "rollouts": _rollouts(tmp_path, [row] * 4)})
    with pytest.raises(DataError) as e:
        _data(cfg)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_recorded_logprobs_on_some_rows_only_are_refused(trainer_models, tmp_path):
    """The sampler's log-probabilities (TRL's rollout_func ``logprobs``) on every recorded row
    or on none: a row without them among rows with them is named."""
    rows = [{"prompt": "a", "completion_ids": [3, 4], "reward": 1.0, "logprobs": [-1.0, -2.0]}
            ] * 3 + [{"prompt": "a", "completion_ids": [3], "reward": 0.0}]
    cfg = _config(trainer_models, tmp_path, data={"sources": []},
                  grpo={"rewards": [], "rollouts": _rollouts(tmp_path, rows)})
    with pytest.raises(DataError) as e:
        _data(cfg)
    assert "rollouts.jsonl:4" in str(e.value) and "on every row" in str(e.value)


def test_a_prompt_without_room_for_the_completion_is_refused(trainer_models, tmp_path):
    cfg = _config(trainer_models, tmp_path, grpo={"max_completion_length": 30})
    with pytest.raises(DataError) as e:
        _data(cfg)
    assert "grpo.jsonl:1" in str(e.value) and "max_completion_length=30" in str(e.value)
    assert isinstance(e.value, UserError)


def test_recorded_completions_as_text_are_tokenised_without_special_tokens(trainer_models,
                                                                           tmp_path):
    from toolkit.train.data import load_tokenizer

    rows = [{"prompt": "a b", "completion": "hello there", "reward": float(i)}
            for i in range(4)]
    cfg = _config(trainer_models, tmp_path, data={"sources": []},
                  grpo={"rewards": [], "rollouts": _rollouts(tmp_path, rows)})
    data = _data(cfg)
    tok = load_tokenizer(trainer_models["tokenizer"])
    assert list(data.groups[0].completion_ids[0]) == \
        tok("hello there", add_special_tokens=False)["input_ids"]
    assert data.groups[0].rewards == (0.0, 1.0, 2.0, 3.0)
    assert list(data.prompts[0].ids) == tok("a b")["input_ids"]


def test_bundled_example_loads(demo_model):
    from toolkit.train.config import load_config

    cfg = load_config("bundled:examples/grpo_tiny.yaml", [f"model.path={demo_model}",
                                                          f"model.tokenizer={demo_model}"])
    assert cfg.data.mode == "grpo" and len(cfg.grpo.rewards) == 2
