"""DPO without ranks: rows rendered exactly as TRL's ``DPOTrainer`` tokenises them, the loss
table against TRL's own loss code, bad rows and configs refused with one clear error, and the
memory model, ``mdtk estimate`` / ``plan`` / ``ds-config`` counting the reference model.
The trainer runs (TRL's metrics at step 0, layouts, memory measured) are tests/test_trainer_dpo.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from toolkit import bundled
from toolkit.cli import app
from toolkit.errors import ConfigError
from toolkit.memory import TrainShape, ZeroOptions, estimate, model_shape_from_hf
from toolkit.parallel.layout import ParallelLayout
from toolkit.planner import DEVICES, Workload
from toolkit.planner.cost import Candidate, Network
from toolkit.planner.step import step_cost
from toolkit.train.config import config_from_dict
from toolkit.train.data import DataError, DataSettings, load_tokenizer, prepare_data
from toolkit.train.data.preference import encode_preference_row
from toolkit.train.objectives.dpo import spec
from toolkit.train.objectives.dpo.losses import LOSSES, Pairs

DPO_FILE = bundled.path("bundled:examples/data/dpo.jsonl")  # conversational rows
TEXT_FILE = bundled.path("bundled:examples/data/dpo_text.jsonl")  # string rows
runner = CliRunner()


@pytest.fixture(scope="module")
def models(trainer_models, tmp_path_factory) -> dict[str, str]:
    from dist_checks.dpo_checks import make_reference

    root = tmp_path_factory.mktemp("dpo_reference")
    return {**trainer_models, "reference": make_reference(trainer_models["dense"], root / "ref")}


def _trl(rows: list[dict], models: dict[str, str], **args):
    """TRL's DPOTrainer on ``rows`` (policy: the dense tiny Llama, reference: its perturbed
    copy), CPU, fp32."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(output_dir=str(Path(models["cache"]).parent / "trl"), use_cpu=True,
                       bf16=False, report_to=[], disable_tqdm=True, **args)
    load = AutoModelForCausalLM.from_pretrained
    return DPOTrainer(model=load(models["dense"], dtype=torch.float32),
                      ref_model=load(models["reference"], dtype=torch.float32), args=config,
                      train_dataset=Dataset.from_list(rows),
                      processing_class=load_tokenizer(models["tokenizer"]))


def _bundled_rows(path: Path = DPO_FILE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _forms() -> dict[str, list[dict]]:
    """Each of TRL's preference forms, from the bundled pairs (TRL reads one form per set)."""
    rows = _bundled_rows()
    strings = _bundled_rows(TEXT_FILE)[:6]
    implicit_strings = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] +
                         r["rejected"]} for r in strings]
    return {"strings": strings, "implicit_strings": implicit_strings,
            "conversational": [r for r in rows if isinstance(r.get("prompt"), list)][:6],
            "implicit_conversational": [r for r in rows if r.get("prompt") is None][:6]}


@pytest.mark.parametrize("form", list(_forms()))
def test_rows_render_as_trl_tokenises_them(models, form):
    """The same prompt, chosen and rejected token ids as TRL's prepared dataset (strings: EOS
    text appended, joint tokenisation, completion from the common prefix; conversations: the
    chat template with / without the generation prompt; implicit prompts extracted)."""
    rows = _forms()[form]
    prepared = _trl(rows, models).train_dataset
    tok = load_tokenizer(models["tokenizer"])
    settings = DataSettings(mode="dpo", sources=(), seq_len=64)
    for row, ref in zip(rows, prepared, strict=True):
        mine = encode_preference_row(row, tok, settings)
        assert mine == (ref["prompt_ids"], ref["chosen_ids"], ref["rejected_ids"]), row


def test_samples_hold_both_rows_and_mask_the_completions(models, tmp_path):
    """prepare_data: [N, 2, seq+1] tokens (chosen, rejected), the mask on completion labels;
    a batch is the chosen rows then the rejected rows (TRL's order)."""
    tok = load_tokenizer(models["tokenizer"])
    settings = DataSettings(mode="dpo", sources=(str(DPO_FILE),), seq_len=48)
    data = prepare_data(settings, models["tokenizer"], tmp_path / "cache")
    assert data.train.tokens.shape == (400, 2, 49) and data.train.loss_mask.shape == (400, 2, 48)
    for i, row in enumerate(_bundled_rows()[:20]):
        p, c, r = encode_preference_row(row, tok, settings)
        for j, completion in enumerate((c, r)):
            ids = p + completion
            assert data.train.tokens[i, j, :len(ids)].tolist() == ids
            assert data.train.loss_mask[i, j].tolist() == (
                [0] * (len(p) - 1) + [1] * len(completion) + [0] * (49 - len(ids)))
    batch = data.train.batch([3, 5])
    assert batch["tokens"].shape == (4, 48)
    assert batch["tokens"][1].tolist() == data.train.tokens[5, 0, :-1].tolist()  # chosen of 5
    assert batch["tokens"][2].tolist() == data.train.tokens[3, 1, :-1].tolist()  # rejected of 3


def test_pairs_whose_prompt_fills_the_sequence_are_dropped_and_counted(models, tmp_path):
    rows = _bundled_rows(TEXT_FILE)[:10] + [{"prompt": "What is 1 plus 2? " * 20,
                                             "chosen": " 3.", "rejected": " 4."}]
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = DataSettings(mode="dpo", sources=(str(source),), seq_len=48)
    data = prepare_data(settings, models["tokenizer"], tmp_path / "cache")
    assert len(data.train) == 10
    assert data.meta["train"]["dropped"] == 1 and data.meta["train"]["pairs"] == 11


BAD_ROWS = {
    "no_rejected": ({"prompt": "Hi", "chosen": " there."}, "has no 'rejected'"),
    "no_chosen": ({"prompt": "Hi", "rejected": " there."}, "has no 'chosen'"),
    "identical": ({"prompt": "Hi", "chosen": " there.", "rejected": " there."},
                  "'chosen' and 'rejected' are the same"),
    "empty_prompt": ({"chosen": "Yes.", "rejected": "No."}, "the prompt is empty"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_rows_are_refused_naming_file_and_line(models, tmp_path, case):
    row, words = BAD_ROWS[case]
    source = tmp_path / "pairs.jsonl"
    source.write_text(json.dumps(_forms()["strings"][0]) + "\n" + json.dumps(row) + "\n")
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as e:
        prepare_data(DataSettings(mode="dpo", sources=(str(source),), seq_len=48),
                     models["tokenizer"], cache)
    assert f"{source}:2:" in str(e.value) and words in str(e.value), str(e.value)
    assert not cache.exists() or not any(cache.iterdir())  # nothing written


def test_a_file_mixing_strings_and_conversations_is_refused(models, tmp_path):
    """HF datasets would read such a column as JSON text (' 3.' -> 3.0): one clear error."""
    source = tmp_path / "pairs.jsonl"
    rows = [_forms()["strings"][0], _forms()["conversational"][0]]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=f"{source}: 'prompt' holds strings in some rows and "
                                        "lists of turns in others; put string rows"):
        prepare_data(DataSettings(mode="dpo", sources=(str(source),), seq_len=48),
                     models["tokenizer"], tmp_path / "cache")


def test_conversations_need_a_chat_template(models, tmp_path):
    source = tmp_path / "pairs.jsonl"
    source.write_text(json.dumps(_forms()["conversational"][0]) + "\n")
    with pytest.raises(DataError, match=f"{source}:1: .*data.template=plain"):
        prepare_data(DataSettings(mode="dpo", sources=(str(source),), seq_len=48,
                                  template="plain"), models["tokenizer"], tmp_path / "cache")


def test_every_loss_equals_trls(models):
    """Each loss of the table against TRL's ``compute_loss`` on one batch of 6 pairs (policy
    and reference two different checkpoints); the per-pair inputs are computed here with
    transformers from TRL's own collated batch."""
    trainer = _trl(_forms()["strings"], models, beta=0.3, per_device_train_batch_size=6)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    ids, completion = batch["input_ids"], batch["completion_mask"].float()

    def logps(model):
        with torch.no_grad():
            out = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
        return (out.gather(-1, ids[:, 1:, None])[..., 0] * completion[:, 1:]).sum(1)

    pairs = Pairs(*logps(trainer.model).chunk(2), *logps(trainer.ref_model).chunk(2),
                  *completion.sum(1).chunk(2))
    trainer.model.eval()
    assert set(LOSSES) == set(spec.LOSSES)
    for name, fn in LOSSES.items():
        smoothing = 0.1 if name in spec.SMOOTHED else 0.0
        trainer.loss_types, trainer.loss_weights = [name], [1.0]
        trainer.label_smoothing = smoothing
        with torch.no_grad():
            theirs = trainer.compute_loss(trainer.model, batch).item()
        mine = fn(pairs, 0.3, smoothing).mean().item()
        assert mine == pytest.approx(theirs, rel=1e-5), name


# -- config ---------------------------------------------------------------------------------------

def _config(models, **sections):
    raw = {"output_dir": "/tmp/unused", "model": {"path": models["dense"]},
           "data": {"mode": "dpo", "sources": [str(DPO_FILE)]}, "train": {"steps": 1}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return config_from_dict(raw)


@pytest.mark.parametrize("sections,words", [
    ({"dpo": {"reference": "REF:odd"}}, ["dpo.reference=", "vocab 507 vs 512"]),
    ({"dpo": {"reference": "REF:moe"}}, ["dpo.reference=", "model_type 'mixtral' vs 'llama'"]),
    ({"dpo": {"reference": "/nowhere/model"}}, ["no HF folder with a config.json"]),
    ({"data": {"mode": "sft"}, "dpo": {"beta": 0.2}}, ["dpo.beta applies to data.mode=dpo"]),
    ({"dpo": {"label_smoothing": 0.1}}, ["read only by the losses robust, exo_pair"]),
    ({"dpo": {"loss": "robust", "label_smoothing": 0.5}}, ["in [0, 0.5)"]),
    ({"dpo": {"loss": "exo_pair"}}, ["exo_pair loss needs it in (0, 1)"]),
    ({"dpo": {"beta": 0.0}}, ["dpo.beta=0.0 must be > 0"]),
    ({"dpo": {"loss": "aot"}}, ["dpo.loss='aot' is not allowed"]),
    ({"data": {"pack": True}}, ["data.pack applies to sft only"]),
])
def test_bad_dpo_settings_are_refused(models, sections, words):
    for value in sections.get("dpo", {}).values():
        if isinstance(value, str) and value.startswith("REF:"):
            sections["dpo"]["reference"] = models[value[4:]]
    with pytest.raises(ConfigError) as e:
        _config(models, **sections)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_dpo_config_defaults_and_reference(models):
    cfg = _config(models, dpo={"reference": models["reference"], "precompute_reference": True})
    assert (cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.label_smoothing) == (0.1, "sigmoid", 0.0)
    assert cfg.dpo.reference == models["reference"] and cfg.dpo.precompute_reference


# -- memory model, planner, CLI --------------------------------------------------------------------

SHAPE = model_shape_from_hf({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
                             "num_hidden_layers": 8, "num_attention_heads": 16,
                             "num_key_value_heads": 8, "vocab_size": 32000})


def _estimate(stage: int = 1, world: int = 4, **train):
    shape = TrainShape(seq_len=1024, micro_batch=2, **train)
    return estimate(SHAPE, shape, ParallelLayout(tp=2).resolve(world), ZeroOptions(stage=stage))


def test_memory_model_counts_the_reference_model():
    plain, pairs = _estimate(), _estimate(pairs=True)
    with_ref = _estimate(pairs=True, reference_model=True)
    ref = [i for i in with_ref.items if i.what.startswith("reference model")]
    per_rank = with_ref.params.total  # this tp rank's parameters, replicated over dp below ZeRO-3
    assert [(i.device, i.bytes) for i in ref] == [("gpu", 2 * per_rank)]
    assert with_ref.model_states() - pairs.model_states() == 2 * per_rank
    # a pair is two rows: the activations of micro_batch 2 pairs are those of 4 sequences
    assert pairs.activations() == _estimate_rows(4).activations() > plain.activations()
    shard = _estimate(stage=3, pairs=True, reference_model=True)
    parts = {i.what: i.bytes for i in shard.items if i.what.startswith("reference model")}
    assert sum(parts.values()) == pytest.approx(2 * per_rank / 2 + 2 * shard.params.persistent,
                                                abs=8)  # 1/dp shard + the small ones whole
    with pytest.raises(ValueError, match="set pairs=True"):
        TrainShape(reference_model=True)


def _estimate_rows(micro: int):
    return estimate(SHAPE, TrainShape(seq_len=1024, micro_batch=micro),
                    ParallelLayout(tp=2).resolve(4), ZeroOptions(stage=1))


def test_planner_adds_the_reference_forward():
    net = Network(DEVICES["h100"], 8)
    c = Candidate(tp=2, dp=4, zero=1, micro_batch=2)
    sft = step_cost(SHAPE, Workload(1024, 64), c, net)
    pre = step_cost(SHAPE, Workload(1024, 64, pairs=True), c, net)
    ref = step_cost(SHAPE, Workload(1024, 64, pairs=True, reference_model=True), c, net)
    assert sft.reference == pre.reference == 0.0
    assert pre.compute == pytest.approx(2 * sft.compute)  # two rows a sample
    # a forward only: about a third of the forward + backward compute, half the tp traffic
    train = pre.compute + pre.tp_comm
    assert 0.25 * train < ref.reference < 0.45 * train
    assert ref.step == pytest.approx(pre.step + ref.reference)


def test_cli_commands_count_the_reference():
    args = ["--model", "llama-3.2-1b", "--tp", "2", "--gpus-per-node", "8", "--seq-len", "2048"]
    res = runner.invoke(app, ["estimate", *args, "--stage", "1", "--dpo", "--json"])
    assert res.exit_code == 0, res.output
    items = {i["what"]: i["bytes"] for i in json.loads(res.output)["items"]}
    assert "reference model (frozen, bf16)" in items
    res = runner.invoke(app, ["estimate", *args, "--dpo", "--precompute-reference", "--json"])
    assert not any(w.startswith("reference") for w in
                   (i["what"] for i in json.loads(res.output)["items"]))
    res = runner.invoke(app, ["estimate", *args, "--precompute-reference"])
    assert res.exit_code != 0 and "applies to --dpo runs" in res.output
    plans = {}
    for extra in ([], ["--dpo", "--precompute-reference"], ["--dpo"]):
        res = runner.invoke(app, ["plan", "--model", "llama-3.2-1b", "--nodes", "1", "--top",
                                  "1", "--seq-len", "2048", "--json", *extra])
        assert res.exit_code == 0, res.output
        plans[" ".join(extra)] = json.loads(res.output)["plans"][0]
    assert plans["--dpo"]["step_time_s"] > plans["--dpo --precompute-reference"]["step_time_s"]
    res = runner.invoke(app, ["ds-config", *args, "--dpo", "--stage", "3", "--offload", "none",
                              "--recompute", "none", "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["zero_optimization"]["stage"] == 3


def test_reference_off_the_trainers_device_is_refused_before_its_forward():
    """The H100 run: a reference model left on the CPU while the batches went to cuda:0 failed
    deep in an embedding lookup. The reference now checks, at its first run, that every tensor
    is on the trainer's device (``runtime.device()``); a module on another device (meta here,
    as cuda vs cpu on a GPU) is named. The trainer's own runs (tests/test_trainer_dpo.py) pass
    the same check on CPU."""
    from toolkit.train.objectives.dpo.reference import ModelReference

    stray = torch.nn.Embedding(8, 4, device="meta")
    batch = {"tokens": torch.zeros(2, 4, dtype=torch.long),
             "loss_mask": torch.ones(2, 4)}
    with pytest.raises(RuntimeError, match=r"DPO reference: weight is on meta, the trainer runs "
                                           r"on cpu"):
        ModelReference([stray], 4).logps([batch])
