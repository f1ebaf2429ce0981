"""Post-training through the real trainer: reward models, KTO, ORPO, SimPO and offline
distillation, each equal to TRL's trainer and the same at every layout.

- TRL: each objective trains 3 steps on the same rows in order (fp32, the same initial weights,
  constant LR, AdamW) in mdtk on one rank and in TRL's ``RewardTrainer``, ``KTOTrainer``,
  ``ORPOTrainer``, ``CPOTrainer(loss_type="simpo")`` and ``GKDTrainer`` (lmbda 0; beta 0.5, and
  0 and 1 for the losses and validations): the
  validation loss before the first step, the 3 training losses and the validation loss after
  them within 1e-5, and TRL's metrics (names and values) before and after.
- The exported reward model, loaded by transformers, scores the validation pairs like mdtk's
  live model (loss, accuracy, margin); a tied causal LM becomes a reward model at pp2 (its
  embedding untied from the new head) and exports as well.
- Layouts: tp2 + sequence parallelism, pp2 and dp2 ZeRO-3 equal the single-rank run of the same
  objective within 1e-5 (losses, validation, metrics).
- Memory: distillation at dp2 ZeRO-3 with a teacher twice the student's size, the engine's and
  the teacher's bytes against the memory model (with the teacher) within 5%.
Bad input, the loss formulas against TRL's code and the memory model's lines are
tests/test_post_training.py (no ranks).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dist_checks import memory_checks, own_cache
from dist_checks import post_checks as pc
from dist_checks.dpo_checks import make_reference
from dist_checks.post_checks import PostCase

from toolkit.memory import TrainShape, estimate, model_shape_from_hf
from toolkit.parallel.layout import ParallelLayout

RTOL = 1e-5
OBJECTIVES = tuple(pc.OBJECTIVES)
LAYOUTS = {"tp2_sp": {"tp": 2, "sp": True}, "pp2": {"pp": 2}, "dp2_zero3": {"zero": 3}}
LAYOUT_CASES = [PostCase(o, f"{o}_{name}", memory=(o, name) == ("distill", "dp2_zero3"),
                         **layout) for o in OBJECTIVES for name, layout in LAYOUTS.items()]
# a tied causal LM (vocab 507, its own score head seeded) as a reward model at pp2, exported
TIED = PostCase("reward", "reward_tied_pp2", pp=2, model="odd",
                overrides=("export.hf_dir={work}/reward_tied_hf",))
# on-policy distillation (lmbda 1: every step on the student's sampled completions), also at
# tp2 and at pp2 x vpp2 (the engine's forwards around the pipeline ring once per chunk; the
# teacher runs at the student's layout: a 4-layer one, a perturbed copy of the student)
ON_POLICY = ("distill.lmbda=1.0", "distill.max_new_tokens=8")
ON_POLICY_T4 = (*ON_POLICY, "distill.teacher={work}/teacher4")
ON_POLICY_LAYOUTS = [  # (the single-rank run it equals, the run)
    ("distill_on_policy", PostCase("distill", "distill_on_policy_tp2", tp=2, overrides=ON_POLICY)),
    ("distill_on_policy_t4", PostCase("distill", "distill_on_policy_pp2_vpp2", pp=2, vpp=2,
                                      overrides=ON_POLICY_T4))]
# the single-rank runs, the reward model exported
# GKD at its ends (forward and reverse KL) through the trainer too, against GKDTrainer
GKD_BETAS = (0.0, 1.0)
SINGLE = [PostCase(o, overrides=("export.hf_dir={work}/reward_hf",) if o == "reward" else ())
          for o in OBJECTIVES] + [PostCase("distill", "distill_on_policy", overrides=ON_POLICY),
                                  PostCase("distill", "distill_on_policy_t4",
                                           overrides=ON_POLICY_T4)] \
    + [PostCase("distill", f"distill_beta{b:g}", overrides=(f"distill.beta={b}",))
       for b in GKD_BETAS] \
    + [PostCase("distill", "distill_teacher_ckpt",
                overrides=("distill.teacher={work}/teacher_mcore_tp2",)),
       PostCase("distill", "distill_teacher_bf16", overrides=("distill.teacher_dtype=bf16",))]


@pytest.fixture(scope="module")
def assets(trainer_assets) -> dict[str, str]:
    """The objectives' rows and models; the teacher also as a megatron-core checkpoint at tp2
    (``mdtk convert``'s), which a distillation run at one rank reads resharded."""
    from toolkit.convert.run import convert

    base, root = trainer_assets
    out = {**pc.make_post_assets(base, root), "work": str(root / "post_runs")}
    convert(out["teacher"], Path(out["work"]) / "teacher_mcore_tp2", to="mcore",
            layout=ParallelLayout(tp=2), workers=1, progress=False)
    make_reference(base["dense"], Path(out["work"]) / "teacher4")
    return out


def _with_work(cases: list[PostCase], work: str) -> list[PostCase]:
    import dataclasses

    return [dataclasses.replace(c, overrides=tuple(o.replace("{work}", work)
                                                   for o in c.overrides)) for c in cases]


@pytest.fixture(scope="module")
def jobs(rank_pool_1, rank_pool_2, assets) -> dict:
    """Both fixtures' pool jobs, started together (the TRL checks run meanwhile)."""
    cases = _with_work([*LAYOUT_CASES, TIED, *(c for _, c in ON_POLICY_LAYOUTS)],
                       assets["work"])
    return {"single": rank_pool_1.submit(pc.run_cases, _with_work(SINGLE, assets["work"]),
                                         own_cache(assets), assets["work"], timeout=600),
            "layouts": rank_pool_2.submit(pc.run_cases, cases, assets, assets["work"],
                                          timeout=900)}


@pytest.fixture(scope="module")
def single(jobs) -> dict[str, dict]:
    (out,) = jobs["single"].result()
    return {r["case"]: r for r in out}


@pytest.fixture(scope="module")
def layouts(jobs) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for rank_results in jobs["layouts"].result():
        for r in rank_results:
            out.setdefault(r["case"], []).append(r)
    return out


# -- TRL -------------------------------------------------------------------------------------------

def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _trl_trainer(objective: str, assets: dict[str, str], gkd_beta: float = 0.5):
    """TRL's trainer of ``objective`` with mdtk's settings (post_checks.OBJECTIVES), CPU, fp32,
    AdamW with mdtk's betas, constant LR, clipping at 1, the rows in order."""
    import transformers as tf
    from datasets import Dataset

    from toolkit.train.data import load_tokenizer

    common = dict(output_dir=str(Path(assets["work"]) / "trl"), use_cpu=True, bf16=False,
                  report_to=[], disable_tqdm=True, per_device_train_batch_size=pc.GLOBAL,
                  per_device_eval_batch_size=pc.VAL_ROWS, learning_rate=pc.LR,
                  lr_scheduler_type="constant", adam_beta2=0.95, max_grad_norm=1.0,
                  weight_decay=0.0, logging_steps=1, max_steps=pc.STEPS, save_strategy="no",
                  train_sampling_strategy="sequential")
    data = {"train_dataset": Dataset.from_list(_rows(assets[f"{objective}_train"])),
            "eval_dataset": Dataset.from_list(_rows(assets[f"{objective}_val"])),
            "processing_class": load_tokenizer(assets["tokenizer"])}
    causal = tf.AutoModelForCausalLM.from_pretrained
    if objective == "reward":
        from trl import RewardConfig, RewardTrainer

        model = tf.AutoModelForSequenceClassification.from_pretrained(assets["seqcls"],
                                                                      dtype=torch.float32)
        return RewardTrainer(model=model, args=RewardConfig(max_length=pc.SEQ, **common), **data)
    model = causal(assets["dense"], dtype=torch.float32)
    if objective == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOTrainer(model=model, args=ORPOConfig(max_length=pc.SEQ + 1, beta=0.1,
                                                        **common), **data)
    if objective == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(max_length=pc.SEQ + 1, loss_type="simpo", beta=2.0, simpo_gamma=0.5,
                         cpo_alpha=0.5, **common)
        return CPOTrainer(model=model, args=args, **data)
    if objective == "kto":
        from trl import KTOConfig, KTOTrainer

        args = KTOConfig(max_length=pc.SEQ + 1, beta=0.1, desirable_weight=1.0,
                         undesirable_weight=1.5, **common)
        return KTOTrainer(model=model, ref_model=causal(assets["dense"], dtype=torch.float32),
                          args=args, **data)
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    return GKDTrainer(model=model, teacher_model=causal(assets["teacher"], dtype=torch.float32),
                      args=GKDConfig(max_length=pc.SEQ + 1, beta=gkd_beta, lmbda=0.0, **common),
                      **data)


_TRL: dict[str, dict] = {}


def _trl(objective: str, assets: dict[str, str], gkd_beta: float = 0.5) -> dict:
    """TRL's validation before training, its training losses and its validation after."""
    key = f"{objective}_{gkd_beta}"
    if key not in _TRL:
        trainer = _trl_trainer(objective, assets, gkd_beta)
        before = trainer.evaluate()
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        _TRL[key] = {"before": before, "losses": losses, "after": trainer.evaluate()}
    return _TRL[key]


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_equal_to_trl(single, assets, objective):
    mine, trl = single[objective], _trl(objective, assets)
    assert mine["losses"] == pytest.approx(trl["losses"], rel=RTOL, abs=1e-7)
    assert len(mine["losses"]) == pc.STEPS and mine["losses"][0] != mine["losses"][-1]
    for step, theirs in ((0, trl["before"]), (pc.STEPS, trl["after"])):
        assert mine["val_losses"][step] == pytest.approx(theirs["eval_loss"], rel=RTOL,
                                                         abs=1e-7), step
        for name, value in mine["val_metrics"].get(step, {}).items():
            assert value == pytest.approx(theirs[f"eval_{name}"], rel=RTOL, abs=1e-6), \
                (step, name)  # TRL's names, TRL's values
    names = set(mine["val_metrics"].get(pc.STEPS, {}))
    assert {"reward": {"accuracy", "margin"}, "kto": {"kl", "rewards/margins"},
            "distill": set()}.get(objective, {"rewards/margins", "nll_loss"}) <= names
    if objective == "kto":  # the KL estimate of the trained policy really is one
        assert mine["val_metrics"][pc.STEPS]["kl"] > 0.1
    # metrics.jsonl holds TRL's names with the step's values
    assert [r["loss"] for r in mine["records"]] == mine["losses"]


def test_exported_reward_model_scores_like_the_live_model(single, assets):
    """transformers' AutoModelForSequenceClassification of the export, on the validation
    pairs as TRL tokenises them: the trained model's loss, accuracy and margin of mdtk's
    validation after the last step; and the export's own check on a padded batch."""
    from transformers import AutoModelForSequenceClassification

    from toolkit.train.data import DataSettings, load_tokenizer
    from toolkit.train.data.reward import encode_reward_row

    mine = single["reward"]
    assert mine["export_diff"] < 1e-5
    model = AutoModelForSequenceClassification.from_pretrained(mine["export_dir"],
                                                               dtype=torch.float32)
    assert model.config.num_labels == 1 and model.config.pad_token_id == 1
    tok = load_tokenizer(assets["tokenizer"])
    settings = DataSettings(mode="reward", sources=(), seq_len=pc.SEQ)
    pairs = [encode_reward_row(r, tok, settings)[:2] for r in _rows(assets["reward_val"])]
    width = max(len(ids) for pair in pairs for ids in pair)
    ids = torch.full((2 * len(pairs), width), tok.pad_token_id)
    for i, pair in enumerate(pairs):
        for j, row in enumerate(pair):
            ids[i + j * len(pairs), :len(row)] = torch.tensor(row)
    with torch.no_grad():
        chosen, rejected = model(ids).logits[:, 0].double().chunk(2)
    val = mine["val_metrics"][pc.STEPS]
    loss = float(-torch.nn.functional.logsigmoid(chosen - rejected).mean())
    assert mine["val_losses"][pc.STEPS] == pytest.approx(loss, rel=RTOL)
    assert val["margin"] == pytest.approx(float((chosen - rejected).mean()), rel=RTOL, abs=1e-6)
    assert val["accuracy"] == float((chosen > rejected).double().mean())


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.label)
def test_layout_matches_single_rank(layouts, single, case):
    ref = single[case.objective]
    ranks = layouts[case.label]
    assert len(ranks) == 2 and (ranks[0]["tp"], ranks[0]["pp"]) == (case.tp, case.pp)
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=1e-7)
        for step, value in ref["val_losses"].items():
            assert r["val_losses"][step] == pytest.approx(value, rel=RTOL, abs=1e-7)
        for mine, theirs in zip(r["metrics"], ref["metrics"], strict=True):
            for name, value in theirs.items():  # (log_odds_chosen: a difference of ~6s)
                assert mine[name] == pytest.approx(value, rel=RTOL, abs=1e-5), name


def test_tied_causal_lm_becomes_a_reward_model_at_pp2(layouts):
    """The tied Llama (vocab 507) as a reward model at pp2: the last stage's copy of the tied
    embedding gives way to the new score head (seeded); it trains and its export, loaded by
    transformers, scores like the live pipeline."""
    for r in layouts[TIED.label]:
        assert r["pp"] == 2 and all(math.isfinite(x) for x in r["losses"])
        assert r["export_diff"] is not None and r["export_diff"] < 1e-5
    folder = layouts[TIED.label][0]["export_dir"]
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]


def test_distillation_memory_with_a_teacher_twice_the_student(layouts, assets):
    """dp2 ZeRO-3: the engine's bytes plus the teacher's (partitioned like the student) against
    the memory model's model states with the teacher (``TrainShape.teacher``)."""
    student = model_shape_from_hf(json.loads((Path(assets["dense"]) / "config.json").read_text()))
    teacher = model_shape_from_hf(json.loads((Path(assets["teacher"]) /
                                              "config.json").read_text()))
    assert 1.8 < teacher.num_params() / student.num_params() < 2.2
    report = []
    for rank, r in enumerate(layouts["distill_dp2_zero3"]):
        zero = memory_checks.zero_options(r["ds_config"])
        shape = TrainShape(seq_len=pc.SEQ, micro_batch=pc.MICRO, dtype="fp32", teacher=teacher)
        predicted = estimate(student, shape, ParallelLayout().resolve(2), zero).model_states()
        measured = r["held"] + r["frozen_held"]
        err = (measured - predicted) / predicted
        report.append(f"rank {rank}: engine {r['held']} + teacher {r['frozen_held']} = "
                      f"{measured}, predicted {predicted} ({100 * err:+.2f}%)")
        assert r["frozen_held"] > 0 and abs(err) < 0.05, report[-1]
    print("\n".join(report))


def test_on_policy_distillation_samples_the_students_completions(single, layouts):
    """distill.lmbda=1: every step trains on completions the student sampled on the ranks (the
    dataset's are gone: its step losses differ from the offline run's while the validation
    before training, on the dataset's rows, is the same), and at tp2 and pp2 x vpp2 the same
    completions and losses as on one rank (seeded sampling, the same at every layout)."""
    on, off = single["distill_on_policy"], single["distill"]
    assert on["val_losses"][0] == pytest.approx(off["val_losses"][0], rel=1e-7)
    assert all(abs(a - b) > 1e-4 for a, b in zip(on["losses"], off["losses"], strict=True))
    for ref, case in ON_POLICY_LAYOUTS:
        run, one = layouts[case.name][0], single[ref]
        assert run["losses"] == pytest.approx(one["losses"], rel=RTOL, abs=1e-7), case.name
        assert run["val_losses"][pc.STEPS] == pytest.approx(one["val_losses"][pc.STEPS],
                                                            rel=RTOL), case.name


@pytest.mark.parametrize("beta", GKD_BETAS)
def test_gkd_at_forward_and_reverse_kl_equal_to_trl(single, assets, beta):
    """distill.beta 0 (KL(teacher || student)) and 1 (KL(student || teacher)) through the
    trainer: GKDTrainer's validation before and after and its 3 losses within 1e-5."""
    mine, trl = single[f"distill_beta{beta:g}"], _trl("distill", assets, beta)
    assert mine["losses"] == pytest.approx(trl["losses"], rel=RTOL, abs=1e-7)
    for step, theirs in ((0, trl["before"]), (pc.STEPS, trl["after"])):
        assert mine["val_losses"][step] == pytest.approx(theirs["eval_loss"], rel=RTOL,
                                                         abs=1e-7), step
    assert mine["losses"] != pytest.approx(single["distill"]["losses"], rel=1e-3)


def test_teacher_from_a_checkpoint_of_another_layout_and_in_its_own_dtype(single):
    """The teacher given as a megatron-core checkpoint written at tp2 (read at the student's
    one rank) trains exactly as its HF folder; the teacher in bf16 beside an fp32 student
    trains close to the fp32 teacher's losses but not equal (it did run in bf16)."""
    hf, ckpt, bf16 = (single[k] for k in ("distill", "distill_teacher_ckpt",
                                          "distill_teacher_bf16"))
    assert ckpt["losses"] == pytest.approx(hf["losses"], rel=RTOL, abs=1e-7)
    assert ckpt["val_losses"] == pytest.approx(hf["val_losses"], rel=RTOL)
    assert bf16["losses"] == pytest.approx(hf["losses"], rel=3e-2)
    assert bf16["losses"] != pytest.approx(hf["losses"], rel=1e-6, abs=1e-7)
