"""Post-training without ranks: the loss formulas against TRL's own code (GKD's generalized JSD
at beta 0, 0.5 and 1; ORPO's odds ratio; CPO's SimPO), the rows as the trainers store them
(a reward's scored position, KTO's KL pairs as TRL rotates them), TRL's config names and
defaults, one clear error for each bad input, and the memory model's teacher. The trainer runs
(TRL's trainers, layouts, export, memory measured) are tests/test_trainer_post.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from toolkit import bundled
from toolkit.errors import ConfigError, UserError
from toolkit.memory import TrainShape, ZeroOptions, estimate, model_shape_from_hf
from toolkit.parallel.layout import ParallelLayout
from toolkit.train.config import config_from_dict
from toolkit.train.data import DataError, DataSettings, prepare_data

TEXT = "bundled:examples/data/dpo_text.jsonl"


def _config(models, mode: str, **sections):
    raw = {"output_dir": "/tmp/unused", "model": {"path": models["dense"],
                                                  "tokenizer": models["tokenizer"]},
           "data": {"mode": mode, "sources": [TEXT]}, "train": {"steps": 1}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return config_from_dict(raw)


# -- the loss formulas against TRL's code ------------------------------------------------------

@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_generalized_jsd_equals_gkds(beta):
    """GKD's ``generalized_jsd_loss`` (masked labels, batchmean) on random logits vs mdtk's
    per-token divergence averaged over the same tokens."""
    from trl.experimental.gkd import GKDTrainer

    from toolkit.train.objectives.distill import generalized_jsd

    g = torch.Generator().manual_seed(1)
    student, teacher = (torch.randn(3, 7, 50, generator=g) * 3 for _ in range(2))
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, :3] = labels[2, 5:] = -100
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta)
    mask = (labels != -100).float()
    mine = (generalized_jsd(student, teacher, beta) * mask).sum() / mask.sum()
    assert float(mine) == pytest.approx(float(theirs), rel=1e-6)
    assert float(mine) > 1e-3


def test_orpo_and_simpo_pair_terms_equal_trls():
    """ORPO's ``odds_ratio_loss`` and CPO's ``cpo_loss(simpo)`` on the same average
    log-probabilities as mdtk's per-pair terms."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    from toolkit.train.objectives.dpo.ref_free import orpo_pair, simpo_pair

    g = torch.Generator().manual_seed(2)
    c, r = -torch.rand(6, generator=g) * 3, -torch.rand(6, generator=g) * 3
    cpu = SimpleNamespace(device="cpu")
    losses, *_, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        SimpleNamespace(beta=0.2, accelerator=cpu), c, r)
    mine, logs = orpo_pair(c, r, 0.2)
    assert torch.allclose(mine, -losses, rtol=1e-6)
    assert float(logs["log_odds_ratio"].mean()) == pytest.approx(float(ratio), rel=1e-6)
    assert float(logs["log_odds_chosen"].mean()) == pytest.approx(float(log_odds), rel=1e-6)
    simpo = SimpleNamespace(alpha=0.0, beta=2.0, simpo_gamma=0.5, loss_type="simpo",
                            label_smoothing=0.0, accelerator=cpu)
    theirs, *_ = CPOTrainer.cpo_loss(simpo, c, r)
    assert torch.allclose(simpo_pair(c, r, 2.0, 0.5)[0], theirs, rtol=1e-6)


# -- rows ---------------------------------------------------------------------------------------

def test_reward_samples_score_the_last_non_padding_token(trainer_models, tmp_path):
    """Each sequence is prompt + completion as TRL tokenises it; the mask marks the one position
    whose score is its reward (transformers' rule: the rightmost non-pad token); pairs with a
    sequence over seq_len are dropped and counted; margins ride along."""
    from toolkit.train.data import load_tokenizer
    from toolkit.train.data.reward import encode_reward_row, last_token

    rows = [json.loads(line) for line in bundled.path(TEXT).read_text().splitlines()][:6]
    rows = [{**r, "margin": 0.5 * i} for i, r in enumerate(rows)]
    rows.append({"prompt": "Say hi. " * 30, "chosen": " hi", "rejected": " no", "margin": 1.0})
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(trainer_models["tokenizer"])
    settings = DataSettings(mode="reward", sources=(str(source),), seq_len=40)
    data = prepare_data(settings, trainer_models["tokenizer"], tmp_path / "cache")
    assert len(data.train) == 6 and data.meta["train"]["dropped"] == 1
    for i, row in enumerate(rows[:6]):
        for j, ids in enumerate(encode_reward_row(row, tok, settings)[:2]):
            assert data.train.tokens[i, j, :len(ids)].tolist() == ids
            assert data.train.loss_mask[i, j].nonzero()[0].tolist() == [
                last_token(ids, tok.pad_token_id)]
    batch = data.train.batch([2, 4])
    assert batch["margin"].tolist() == [1.0, 2.0] and batch["tokens"].shape == (4, 40)


def test_kto_kl_pairs_rotate_as_trl_does(trainer_models, tmp_path):
    """The KL row of a sample: its prompt + the completion its neighbour gives it under TRL's
    rotation inside batches (``add_kl_completion_ids``, batch = the global batch)."""
    from toolkit.train.data.kto import kl_batch, kl_partner

    completions = list(range(10))
    trl = []
    for a in range(0, 10, 4):  # TRL: dataset.map(batched=True, batch_size=4)
        chunk = completions[a:a + 4]
        trl += [chunk[-1]] + chunk[:-1]
    assert [kl_partner(i, 10, 4) for i in range(10)] == trl
    source = tmp_path / "kto.jsonl"
    rows = [json.loads(line) for line in bundled.path(
        "bundled:examples/data/kto.jsonl").read_text().splitlines()][:10]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare_data(DataSettings(mode="kto", sources=(str(source),), seq_len=48),
                        trainer_models["tokenizer"], tmp_path / "cache")
    split = data.train
    kl = kl_batch(split, [5, -1], 4)
    p, j = int(split.extra["prompt_len"][5]), trl[5]
    c = int(split.extra["completion_len"][j])
    assert kl["tokens"][0, :p].tolist() == split.tokens[5, :p].tolist()
    assert kl["tokens"][0, p:p + c].tolist() == split.extra["completion"][j, :c].tolist()
    assert kl["loss_mask"][0].sum() == c and kl["loss_mask"][1].sum() == 0  # a filler
    assert split.batch([0, 2])["label"].tolist() == [float(rows[0]["label"]),
                                                      float(rows[2]["label"])]
    # mdtk data preview: the label, the completion as the loss span
    from toolkit.train.data import load_tokenizer
    from toolkit.train.data.preview import render, summarize

    summary = summarize(data)
    assert summary["desirable"] == sum(r["label"] for r in rows) and summary["rows_read"] == 10
    shown = render(split, 0, load_tokenizer(trainer_models["tokenizer"]))
    assert shown.startswith("(desirable) " if rows[0]["label"] else "(undesirable) ")
    assert "[[" + rows[0]["completion"] in shown


def test_data_preview_of_grpo_prompts_and_recorded_rollouts(trainer_models, tmp_path):
    """``mdtk data preview`` of a GRPO run: each prompt as the model sees it (a chat prompt
    rendered by the template with the generation prompt), its token count and the columns the
    reward functions receive; recorded groups with each completion decoded and its reward;
    counts over all of them. A reward function that cannot read the rows is refused there."""
    import yaml
    from typer.testing import CliRunner

    from toolkit.cli import app
    from toolkit.train.data import load_tokenizer

    tok = load_tokenizer(trainer_models["tokenizer"])
    rows = [{"prompt": "two plus three is", "answer": "five"},
            {"prompt": [{"role": "user", "content": "one plus one?"}], "answer": "two"},
            {"prompt": "seven minus two is", "answer": "five", "level": 2}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = [tok(rows[0]["prompt"])["input_ids"], tok.apply_chat_template(
        rows[1]["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True)[
        "input_ids"], tok(rows[2]["prompt"])["input_ids"]]
    raw = {"output_dir": str(tmp_path / "out"),
           "model": {"path": trainer_models["dense"], "tokenizer": trainer_models["tokenizer"]},
           "data": {"mode": "grpo", "sources": [str(prompts)]},
           "train": {"steps": 1, "seq_len": 64, "global_batch": 4},
           "grpo": {"num_generations": 2, "max_completion_length": 8,
                    "rewards": [{"function": "mdtk:answer_prefix"}]}}

    def preview(config: dict, *more: str):
        path = tmp_path / "grpo.yaml"
        path.write_text(yaml.safe_dump(config))
        return CliRunner().invoke(app, ["data", "preview", str(path), "--rows", "2", *more])

    res = preview(raw)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    first = next(i for i, line in enumerate(lines)  # (after datasets' progress bar)
                 if line.endswith(f"--- prompt 0 ({prompts}:1), {len(ids[0])} tokens ---"))
    # the columns as the reward functions get them (a column another row has: null here)
    assert lines[first + 1:first + 3] == [tok.decode(ids[0]), 'reward columns: {"answer": '
                                                              '"five", "level": null}']
    assert f"--- prompt 1 ({prompts}:2), {len(ids[1])} tokens ---" in lines
    assert tok.decode(ids[1]) in res.output and "<|assistant|>" in tok.decode(ids[1])
    assert "--- prompt 2" not in res.output  # --rows 2
    n = [len(i) for i in ids]
    assert (f"prompts 3, prompt tokens: min {min(n)}, mean {sum(n) / 3:.1f}, max {max(n)}"
            in lines)
    # recorded rollouts: groups of num_generations, completions as ids or text
    recorded = tmp_path / "rollouts.jsonl"
    group = [{"prompt": "two plus three is", "completion": " five", "reward": 1.0},
             {"prompt": "two plus three is", "completion_ids": [5, 6, 7], "reward": 0.25},
             {"prompt": "one and one", "completion": " two", "reward": 0.5},
             {"prompt": "one and one", "completion": " three", "reward": 0.0}]
    recorded.write_text("".join(json.dumps(r) + "\n" for r in group))
    res = preview({**raw, "data": {"mode": "grpo"},
                   "grpo": {"num_generations": 2, "rollouts": str(recorded)}})
    assert res.exit_code == 0, res.output
    five = tok(" five", add_special_tokens=False)["input_ids"]
    assert f"  completion 0 ({len(five)} tokens, reward 1): {tok.decode(five)}" in res.output
    assert f"  completion 1 (3 tokens, reward 0.25): {tok.decode([5, 6, 7])}" in res.output
    assert "--- group 1: prompt" in res.output
    assert "rewards: mean 0.4375, min 0, max 1" in res.output
    # a reward function reading a column the rows lack: refused before any model is built
    res = preview({**raw, "grpo": {**raw["grpo"], "rewards": [
        {"function": "mdtk:answer_prefix", "args": {"column": "solution"}}]}})
    assert isinstance(res.exception, UserError), res.output  # mdtk prints it as one error line
    assert "reads the rows' 'solution' column; the data has ['answer', 'level']" in str(
        res.exception)


BAD_KTO = {
    "no_label": ({"prompt": "Hi", "completion": " there."}, "has no 'label'"),
    "label_text": ({"prompt": "Hi", "completion": " there.", "label": "yes"},
                   "label 'yes': 'label' must be true"),
    "paired": ({"prompt": "Hi", "chosen": " a.", "rejected": " b."}, "data.mode=dpo"),
}


@pytest.mark.parametrize("case", list(BAD_KTO))
def test_bad_kto_rows_are_refused_naming_file_and_line(trainer_models, tmp_path, case):
    row, words = BAD_KTO[case]
    good = {"prompt": "Hi", "completion": " there.", "label": True}
    source = tmp_path / "kto.jsonl"
    source.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        prepare_data(DataSettings(mode="kto", sources=(str(source),), seq_len=32),
                     trainer_models["tokenizer"], tmp_path / "cache")
    assert f"{source}:2:" in str(e.value) and words in str(e.value), str(e.value)


def test_one_class_of_kto_rows_and_partial_margins_are_refused(trainer_models, tmp_path):
    source = tmp_path / "kto.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"Q{i}?", "completion": " A.",
                                          "label": True}) + "\n" for i in range(4)))
    with pytest.raises(DataError, match="every training row of data.mode=kto is desirable"):
        prepare_data(DataSettings(mode="kto", sources=(str(source),), seq_len=32),
                     trainer_models["tokenizer"], tmp_path / "cache")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Q?", "chosen": " A.", "rejected": " B.",
                                 "margin": 1.0}) + "\n" + json.dumps(
        {"prompt": "Q?", "chosen": " A.", "rejected": " C."}) + "\n")
    with pytest.raises(DataError, match="'margin' is given on some rows but not on row 2"):
        prepare_data(DataSettings(mode="reward", sources=(str(pairs),), seq_len=32),
                     trainer_models["tokenizer"], tmp_path / "cache")


# -- config ----------------------------------------------------------------------------------------

def test_trls_names_and_defaults():
    from trl import KTOConfig, RewardConfig
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.gkd import GKDConfig

    from toolkit.train.config.schema import DistillSection, DpoSection, KtoSection, RewardSection

    kw = {"output_dir": "/tmp/unused", "report_to": [], "use_cpu": True, "bf16": False}
    kto, cpo, gkd = KTOConfig(**kw), CPOConfig(**kw), GKDConfig(**kw)
    assert (KtoSection().beta, KtoSection().desirable_weight, KtoSection().undesirable_weight) \
        == (kto.beta, kto.desirable_weight, kto.undesirable_weight)
    assert (DpoSection().simpo_gamma, DpoSection().cpo_alpha) == (cpo.simpo_gamma,
                                                                  cpo.cpo_alpha)
    assert (DistillSection().beta, DistillSection().temperature) == (gkd.beta, gkd.temperature)
    assert DistillSection().lmbda == 0.0  # offline unless asked (TRL's default is 0.5)
    assert DistillSection().max_new_tokens == gkd.max_new_tokens
    assert RewardSection().center_rewards_coefficient == \
        RewardConfig(**kw).center_rewards_coefficient


@pytest.fixture(scope="module")
def other_tokenizer_teacher(trainer_models, tmp_path_factory) -> str:
    """The dense model with a tokenizer of other tokens beside it."""
    import shutil

    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("teacher")
    build_tiny_tokenizer(root / "model", vocab_size=300)
    shutil.copytree(trainer_models["dense"], root / "model", dirs_exist_ok=True)
    return str(root / "model")


@pytest.mark.parametrize("mode,sections,words", [
    ("distill", {"distill": {"teacher": "MODEL:odd"}},
     ["vocabulary of 507 tokens, the student 512", "must share the tokenizer"]),
    ("distill", {"distill": {"teacher": "MODEL:other_tokenizer"}},
     ["its tokenizer is not the student's", "must share the tokenizer"]),
    ("distill", {}, ["data.mode=distill needs distill.teacher"]),
    ("distill", {"distill": {"teacher": "MODEL:moe"}, "parallel": {"pp": 2, "vpp": 2}},
     ["distill.teacher=", "runs at the student's layout", "num_hidden_layers=2"]),
    ("distill", {"distill": {"teacher": "MODEL:dense", "lmbda": 0.5}, "data": {"pack": True}},
     ["distill.lmbda > 0 with data.pack", "set data.pack=false"]),
    ("distill", {"distill": {"teacher": "MODEL:dense", "lmbda": 1.5}}, ["must be in [0, 1]"]),
    ("distill", {"distill": {"teacher": "MODEL:dense", "beta": 1.5}}, ["must be in [0, 1]"]),
    ("kto", {}, ["set data.shuffle=false"]),
    ("kto", {"data": {"shuffle": False}, "train": {"global_batch": 1}},
     ["train.global_batch=1", "batch > 1"]),
    ("reward", {"peft": {"method": "lora"}}, ["set peft.method=none"]),
    ("reward", {"model": {"path": "MODEL:two_labels"}}, ["num_labels=2"]),
    ("sft", {"kto": {"beta": 0.2}}, ["kto.beta applies to data.mode=kto"]),
    ("dpo", {"dpo": {"loss": "orpo", "reference": "MODEL:dense"}},
     ["dpo.reference with dpo.loss=orpo", "reference-free"]),
    ("dpo", {"dpo": {"simpo_gamma": 1.0}}, ["read by dpo.loss=simpo only"]),
    ("kto", {"data": {"pack": True}}, ["data.pack applies to sft only", "data.mode=kto"]),
])
def test_bad_settings_are_refused(trainer_models, other_tokenizer_teacher, tmp_path, mode,
                                  sections, words):
    """One clear error each, before anything runs."""
    import shutil

    models = {**trainer_models, "other_tokenizer": other_tokenizer_teacher}
    if any("two_labels" in str(v) for v in sections.values()):
        folder = tmp_path / "two"
        shutil.copytree(trainer_models["dense"], folder)
        config = json.loads((folder / "config.json").read_text())
        config.update(architectures=["LlamaForSequenceClassification"], num_labels=2)
        (folder / "config.json").write_text(json.dumps(config))
        models["two_labels"] = str(folder)
    resolved = {k: {kk: models[vv[6:]] if isinstance(vv, str) and vv.startswith("MODEL:")
                    else vv for kk, vv in v.items()} for k, v in sections.items()}
    with pytest.raises(ConfigError) as e:
        _config(models, mode, **resolved)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("example", ["reward_tiny", "kto_tiny", "orpo_tiny", "distill_tiny"])
def test_bundled_examples_load(trainer_models, example):
    from toolkit.train.config import load_config

    dense = trainer_models["dense"]
    cfg = load_config(f"bundled:examples/{example}.yaml", [
        f"model.path={dense}", f"model.tokenizer={trainer_models['tokenizer']}",
        *([f"distill.teacher={dense}"] if example == "distill_tiny" else [])])
    mode = {"orpo_tiny": "dpo"}.get(example, example.removesuffix("_tiny"))
    assert cfg.data.mode == mode and all(Path(p).is_file() for p in cfg.data.sources)


# -- memory model ------------------------------------------------------------------------------

SHAPE = model_shape_from_hf({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
                             "num_hidden_layers": 8, "num_attention_heads": 16,
                             "num_key_value_heads": 8, "vocab_size": 32000})
TEACHER = model_shape_from_hf({"model_type": "llama", "hidden_size": 2048,
                               "intermediate_size": 5632, "num_hidden_layers": 8,
                               "num_attention_heads": 16, "num_key_value_heads": 8,
                               "vocab_size": 32000})


def test_memory_model_counts_the_teacher():
    """The teacher's weights per rank (its own tensors at the student's layout; ZeRO-3: a 1/dp
    shard) and, on the last stage, its logits of the step's micro-batches."""
    from toolkit.memory.states import rank_params

    layout = ParallelLayout(tp=2).resolve(4)
    train = TrainShape(seq_len=1024, micro_batch=2, global_batch=8, teacher=TEACHER)
    plain = estimate(SHAPE, TrainShape(seq_len=1024, micro_batch=2, global_batch=8), layout,
                     ZeroOptions(stage=1))
    mine = estimate(SHAPE, train, layout, ZeroOptions(stage=1))
    items = {i.what: i.bytes for i in mine.items if i.what.startswith("teacher")}
    held = rank_params(TEACHER, layout, 0).total
    assert items["teacher model (frozen, bf16)"] == 2 * held
    assert items["teacher logits of one step"] == 2 * 2 * 1024 * (32000 // 2) * 2  # m=2
    assert mine.model_states() - plain.model_states() == 2 * held
    zero3 = ZeroOptions(stage=3)
    shard = estimate(SHAPE, train, layout, zero3)
    parts = {i.what: i.bytes for i in shard.items if i.what.startswith("teacher model")}
    p = rank_params(TEACHER, layout, 0, zero3.param_persistence_threshold)
    assert sum(parts.values()) == 2 * (-(-p.dense // p.dense_dp)) + 2 * p.persistent
    assert sum(parts.values()) < 0.6 * 2 * held  # about a 1/dp shard of the bf16 teacher
    # KTO: a reference without pairs
    kto = estimate(SHAPE, TrainShape(seq_len=1024, micro_batch=2, unpaired=True,
                                     reference_model=True), layout, ZeroOptions(stage=1))
    assert any(i.what.startswith("reference model") for i in kto.items)


GRPO_REWARD = {"function": "mdtk:format_regex", "args": {"pattern": "[0-9]"}}


def test_memory_model_counts_grpos_reference_and_rollout_cache(trainer_models):
    """A GRPO run = SFT's items + the reference (grpo.beta != 0; none with LoRA: the policy
    with its adapters off) + the generation engine's KV cache (without grpo.rollouts): 2 (key,
    value) x layers on the rank x rows (global / dp) x (seq_len + 1) x kv heads / tp x head dim
    x 2 bytes; exactly those items and nothing else."""
    from toolkit.lora.spec import LoraSpec
    from toolkit.memory.activations import GRPO_LOSS_LINE
    from toolkit.memory.estimate import kv_cache_bytes
    from toolkit.memory.states import rank_params
    from toolkit.train.objectives.spec import train_shape_fields

    def fields(**grpo):
        if "rollouts" in grpo:  # the recorded rollouts hold the prompts
            sections = {"grpo": grpo, "data": {"sources": []}}
        else:
            sections = {"grpo": {"rewards": [GRPO_REWARD], **grpo}}
        return train_shape_fields(_config(trainer_models, "grpo", train={"global_batch": 8},
                                          **sections))

    generating = fields(beta=0.04)
    assert generating == {"grpo": True, "reference_model": True, "rollout_cache": True}
    assert fields() == {"grpo": True, "reference_model": False, "rollout_cache": True}
    assert fields(rollouts="r.jsonl", beta=0.04) == {"grpo": True, "reference_model": True,
                                                     "rollout_cache": False}
    layout, zero = ParallelLayout(tp=2).resolve(4), ZeroOptions(stage=1)
    base = {"seq_len": 1024, "micro_batch": 2, "global_batch": 8}

    def added(shape, **more):  # GRPO's items beyond SFT's, and the difference of the totals
        sft = estimate(shape, TrainShape(**base), layout, zero)
        grpo = estimate(shape, TrainShape(**base, **more), layout, zero)
        items = {i.what: i.bytes for i in grpo.items if i not in sft.items}
        assert grpo.gpu - sft.gpu == sum(items.values())
        return items

    kv = 8 * 2 * 4 * 1025 * (8 // 2) * 64 * 2  # layers, k + v, rows, tokens, kv heads, dim, bf16
    ref = {"reference model (frozen, bf16)": 2 * rank_params(SHAPE, layout, 0).total}
    cache = {"rollout KV cache (4 rows x 1025 tokens)": kv}
    loss = {GRPO_LOSS_LINE: 4 * 2 * 1024 * 32000 // 2}  # fp32, micro-batch, seq, vocab / tp
    assert added(SHAPE, **generating) == {**ref, **cache, **loss}
    assert added(SHAPE, **fields()) == {**cache, **loss}
    assert added(SHAPE, **fields(rollouts="r.jsonl", beta=0.04)) == {**ref, **loss}
    lora = model_shape_from_hf({"model_type": "llama", "hidden_size": 1024,
                                "intermediate_size": 2816, "num_hidden_layers": 8,
                                "num_attention_heads": 16, "num_key_value_heads": 8,
                                "vocab_size": 32000}, lora=LoraSpec(targets=frozenset({"q_proj"})))
    assert added(lora, **generating) == {**cache, **loss}
    # a pipeline stage caches its own layers; kv heads split over tp, one a rank below tp
    pp2 = ParallelLayout(tp=2, pp=2).resolve(8)
    last = estimate(SHAPE, TrainShape(**base, **generating), pp2, zero, pipeline_stage=1)
    assert [i.bytes for i in last.items if i.what.startswith("rollout")] == [kv // 2]
    assert kv_cache_bytes(SHAPE, (0, 1), 1, 3, 10, "fp32") == 2 * 3 * 10 * 8 * 64 * 2 * 4
    assert kv_cache_bytes(SHAPE, (0, 1), 16, 3, 10, "fp32") == 2 * 3 * 10 * 1 * 64 * 2 * 4


def test_a_vllm_engine_holds_its_share_of_the_device_not_mdtks_kv_cache(trainer_models,
                                                                       monkeypatch):
    """grpo.engine=vllm: no megatron-core KV cache is counted, and the DeepSpeed sizing keeps
    vLLM's ``vllm_gpu_memory_utilization`` share of the device free (megatron: nothing)."""
    from toolkit.infer import vllm_engine
    from toolkit.train.objectives.spec import engine_reserve, train_shape_fields

    monkeypatch.setattr(vllm_engine, "vllm_missing", lambda: None)  # config checks pass

    def cfg(**grpo):
        return _config(trainer_models, "grpo", train={"global_batch": 8},
                       grpo={"rewards": [GRPO_REWARD], **grpo})

    vllm = cfg(engine="vllm", vllm_gpu_memory_utilization=0.25)
    assert train_shape_fields(vllm) == {"grpo": True, "reference_model": False,
                                        "rollout_cache": False}
    assert engine_reserve(vllm, 80 * 2**30) == 20 * 2**30
    assert engine_reserve(cfg(), 80 * 2**30) == 0


def test_grpo_loss_saves_what_the_memory_model_counts():
    """GRPO's loss (per-token log-probabilities of the vocabulary-parallel logits, fp32, with
    the entropy) saves two fp32 tensors of the logits' size for backward at any temperature
    (its exp and, kept by the gather, the log-softmax): the "final norm, logits and loss"
    line's fp32 softmax plus GRPO's own line."""
    from toolkit.memory.activations import GRPO_LOSS_LINE, activation_bytes
    from toolkit.memory.states import rank_params
    from toolkit.train.objectives.grpo.loss import token_logps

    shape = model_shape_from_hf({"model_type": "llama", "hidden_size": 16,
                                 "intermediate_size": 32, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 2,
                                 "vocab_size": 40})
    layout = ParallelLayout().resolve(1)
    lines = activation_bytes(shape, TrainShape(seq_len=5, micro_batch=2, grpo=True), layout,
                             rank_params(shape, layout), 0, 1)
    counted = lines[GRPO_LOSS_LINE] + 4 * 2 * 5 * 40  # + the fp32 softmax of the logits line

    logits = torch.randn(2, 5, 40, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 5))
    for temperature in (1.0, 0.7):
        saved: dict[int, int] = {}

        def keep(t, saved=saved):
            if t.numel() >= logits.numel() and t.data_ptr() != logits.data_ptr():
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            logp, _ = token_logps(logits, labels, 40, temperature, entropy=True)
        assert logp.shape == (2, 5)
        assert sum(saved.values()) == counted == 8 * logits.numel(), (temperature, saved)


def test_estimate_counts_a_teacher():
    from typer.testing import CliRunner

    from toolkit.cli import app

    args = ["estimate", "--model", "llama-3.2-1b", "--tp", "2", "--gpus-per-node", "8",
            "--seq-len", "2048", "--stage", "1", "--json"]
    plain = json.loads(CliRunner().invoke(app, args).output)
    res = CliRunner().invoke(app, [*args, "--teacher", "llama-3.1-8b"])
    assert res.exit_code == 0, res.output
    items = {i["what"]: i["bytes"] for i in json.loads(res.output)["items"]}
    teacher = items["teacher model (frozen, bf16)"]
    assert teacher > 5 * sum(i["bytes"] for i in plain["items"]
                             if i["what"].startswith("16-bit parameters"))


def test_each_objective_tells_the_memory_model_what_it_holds(trainer_models):
    from toolkit.train.objectives.spec import train_shape_fields

    def fields(mode, **sections):
        return train_shape_fields(_config(trainer_models, mode, **sections))

    assert fields("dpo", dpo={"loss": "orpo"}) == {"pairs": True, "reference_model": False}
    assert fields("dpo") == {"pairs": True, "reference_model": True}
    assert fields("reward") == {"pairs": True}
    assert fields("kto", data={"shuffle": False}) == {"unpaired": True,
                                                        "reference_model": True}
    teacher = fields("distill", distill={"teacher": trainer_models["moe"]})["teacher"]
    assert teacher.experts == 4


def test_plan_counts_grpos_rollout_cache_and_reference():
    """``mdtk plan --grpo [--grpo-reference]``: the same plan's memory grows by exactly the
    rollout KV cache, the loss's log-softmax line and (with the reference) the frozen model the
    memory model counts for that plan; --emit is refused with the reason."""
    from toolkit.memory import GPU
    from toolkit.planner.emit import EmitError, emit
    from toolkit.planner.report import PlanRequest, plan_layouts
    from toolkit.planner.search import check_fit, train_shape

    def plan(**kw):
        req = PlanRequest("llama-3.1-8b", nodes=1, gpus_per_node=8, top=1, seq_len=2048,
                          global_batch=64, **kw)
        return plan_layouts(req)

    sft, rl, rl_ref = plan(), plan(grpo=True), plan(grpo=True, grpo_reference=True)
    for report in (rl, rl_ref):
        best = report.result.plans[0]
        shape = train_shape(report.work, best.candidate)
        assert shape.grpo and shape.rollout_cache
        assert shape.reference_model == (report is rl_ref)
        names = {i.what for i in best.estimate.items}
        assert any(n.startswith("rollout KV cache") for n in names)
        assert any(n.startswith("reference model") for n in names) == (report is rl_ref)
        # the same candidate without GRPO: the difference is exactly GRPO's own lines
        plain = check_fit(report.setting.shape, sft.work, best.candidate, report.setting.cluster)
        extra = [i for i in best.estimate.items if i not in plain.estimate.items]
        assert {i.what.split(" (")[0] for i in extra} >= {"rollout KV cache"}
        assert best.estimate.gpu - plain.estimate.gpu == sum(i.bytes for i in extra
                                                              if i.device == GPU) > 0
    with pytest.raises(EmitError, match="--emit with --grpo"):
        emit(rl, Path("/tmp/unused_emit"), "llama-3.1-8b")
    with pytest.raises(ValueError, match="--grpo-reference applies to --grpo"):
        plan(grpo_reference=True)


def test_plan_with_vllm_rollouts_keeps_vllms_share_free():
    """``mdtk plan --grpo --grpo-vllm SHARE``: no mdtk KV cache in any plan, and SHARE of each
    GPU reserved as the trainer reserves it (``objectives.spec.engine_reserve``): a larger share
    rejects more candidates."""
    from toolkit.planner.report import PlanRequest, plan_layouts
    from toolkit.planner.search import Budget, train_shape

    def plan(**kw):
        return plan_layouts(PlanRequest("llama-3.1-8b", nodes=1, gpus_per_node=8, top=1,
                                        seq_len=2048, global_batch=64, **kw))

    vllm = plan(grpo=True, grpo_vllm=0.3)
    best = vllm.result.plans[0]
    assert train_shape(vllm.work, best.candidate).grpo
    assert not train_shape(vllm.work, best.candidate).rollout_cache
    assert not any(i.what.startswith("rollout KV cache") for i in best.estimate.items)
    gpu_mem = vllm.setting.cluster.gpu_mem
    assert vllm.setting.budget.gpu_reserve == Budget().gpu_reserve + int(0.3 * gpu_mem)
    assert plan(grpo=True, grpo_vllm=0.8).result.rejected_memory > vllm.result.rejected_memory
    for bad in ({"grpo_vllm": 0.3}, {"grpo": True, "grpo_vllm": 1.5}):
        with pytest.raises(ValueError, match="--grpo-vllm"):
            plan(**bad)


def test_plan_says_which_vllm_tensor_parallel_size_fits_its_share():
    """``mdtk plan --grpo-vllm 0.3`` lists, per grpo.vllm_tensor_parallel_size, the engine's
    weights per GPU (bf16: 2 bytes a parameter, split over its ranks) and the KV cache its share
    leaves, in tokens: Llama-3.1-8B's KV cache is 128 KiB a token (32 layers x 8 KV heads x 128
    x key and value x 2 bytes), halved per rank at tp2; Llama-3.1-70B does not fit 0.3 of an
    80 GiB H100 below 8 ranks an engine."""
    from typer.testing import CliRunner

    from toolkit.cli import app
    from toolkit.memory import load_model_shape, vllm_fits

    share, gpu = int(0.3 * 80 * 2**30), 80 * 2**30
    small = load_model_shape("llama-3.1-8b")
    one, two = vllm_fits(small, 0.3, gpu, "bf16", (1, 2))
    assert one.weights == 2 * small.num_params() and two.weights == small.num_params()
    assert one.kv_tokens == (share - one.weights) // 131072
    assert two.kv_tokens == (share - two.weights) // 65536
    big = vllm_fits(load_model_shape("llama-3.1-70b"), 0.3, gpu, "bf16", (1, 2, 4, 8))
    assert [f.fits for f in big] == [False, False, False, True]
    out = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-70b", "--nodes", "2", "--grpo",
                                   "--grpo-vllm", "0.3", "--top", "1"])
    assert out.exit_code == 0, out.output
    assert "4: 32.9 GiB, does not fit; 8: 16.4 GiB, 198,519 tokens" in out.output, out.output
