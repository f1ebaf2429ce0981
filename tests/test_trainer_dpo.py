"""DPO through the real trainer (``data.mode: dpo``): equal to TRL's ``DPOTrainer``, the same
losses at every layout, a DPO run after SFT learns the preferences, memory as the model says.

- TRL: validation before the first update (policy: the trainer tests' tiny Llama, reference: a
  perturbed copy, i.e. two different checkpoints) on 8 held-out pairs, string rows and
  conversational rows, against ``DPOTrainer.evaluate()`` on CPU in fp32 on the same rows.
- Layouts: the first 2 steps' losses and TRL metrics at tp2 (+sp, precomputed reference), cp2,
  dp2 ZeRO-3 (the reference partitioned like the policy), tp2 x pp2 equal the single-rank run
  (model reference) within 1e-5 relative, fp32; so do GPT-OSS at ep2 and GLM-4.5 at tp2 + SP
  against their own single-rank runs (each with a perturbed copy as its reference).
- Memory: at dp2 ZeRO-3, per rank, the engine's and the reference model's bytes against the
  memory model's model states, with and without a reference model.
- LoRA: the reference is the policy with its adapters off, equal to the base's precomputed
  log-probabilities.
Bad rows, bad configs, the loss table vs TRL and the CLI are tests/test_dpo.py (no ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_checks import background, memory_checks, own_cache
from dist_checks import dpo_checks as dc
from dist_checks.dpo_checks import DpoCase

from toolkit import bundled
from toolkit.memory import TrainShape, estimate, model_shape_from_hf
from toolkit.parallel.layout import ParallelLayout
from toolkit.train.objectives.dpo.spec import METRICS

LOSS_RTOL = 1e-5
VAL_SEQ, VAL_PAIRS = 64, 8
SFT_STEPS, DPO_STEPS = 30, 16
CASES_2 = [
    DpoCase("tp2_sp_pre", tp=2, sp=True, precompute=True),
    DpoCase("cp2", cp=2),
    DpoCase("dp2_zero3", zero=3, memory=True),
    # issue 39's families: GPT-OSS (sinks, sliding window, biased clamped experts) at ep2,
    # GLM-4.5 (sigmoid group routing, shared expert, partial RoPE, q/k norm) at tp2 + SP
    DpoCase("gpt_oss_ep2", model="gpt_oss", ep=2, ref="ref_gpt_oss"),
    DpoCase("glm_tp2_sp", model="glm", tp=2, sp=True, ref="ref_glm"),
]
FAMILIES = ("gpt_oss", "glm")
REFS = [DpoCase("ref"), *(DpoCase(f"ref_{m}", model=m) for m in FAMILIES)]
CASES_4 = [DpoCase("tp2_pp2", tp=2, pp=2)]  # pipeline (and tp with it)
# LoRA at dp2: the reference is the policy with its adapters off, vs the base checkpoint's
# log-probabilities precomputed (the same model, loaded on its own)
LORA_CASES = [DpoCase("lora", overrides=dc.LORA),
              DpoCase("lora_pre", precompute=True, overrides=dc.LORA)]


@pytest.fixture(scope="module")
def assets(trainer_assets) -> dict[str, str]:
    out, root = trainer_assets
    out = {**out, "work": str(root / "dpo_runs"),
           **{dc.reference_key(m): dc.make_reference(out[m], root / f"dpo_reference_{m}")
              for m in ("dense", *FAMILIES)}}
    for form, path in (("strings", "dpo_text.jsonl"), ("conversational", "dpo.jsonl")):
        lines = bundled.path(f"bundled:examples/data/{path}").read_text().splitlines()
        rows = [r for r in map(json.loads, lines) if "prompt" in r][-VAL_PAIRS:]
        (root / f"val_{form}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[f"val_{form}"] = str(root / f"val_{form}.jsonl")
    return out


@pytest.fixture(scope="module")
def jobs(assets, rank_pool_1, rank_pool_2, rank_pool_4) -> dict:
    """Both fixtures' pool jobs, started together (the TRL checks run meanwhile)."""
    return {"one": rank_pool_1.submit(
        dc.single_rank_checks, own_cache(assets), assets["work"], REFS,
        {f: assets[f"val_{f}"] for f in ("strings", "conversational")},
        VAL_SEQ, SFT_STEPS, DPO_STEPS, timeout=600),
        "n": background(_results_n, rank_pool_2, rank_pool_4, assets)}


@pytest.fixture(scope="module")
def results_1(jobs):
    """One rank: the layout reference, validation at step 0 per row form, SFT -> DPO."""
    (out,) = jobs["one"].result()
    return out


@pytest.fixture(scope="module")
def results_n(jobs):
    return jobs["n"].result()


def _results_n(rank_pool_2, rank_pool_4, assets) -> dict[str, list[dict]]:
    two = rank_pool_2.run(dc.run_cases, CASES_2 + LORA_CASES, assets, assets["work"],
                          timeout=600)
    four = rank_pool_4.run(dc.run_cases, CASES_4, assets, assets["work"], timeout=600)
    out: dict[str, list[dict]] = {}
    for rank_results in two + four:
        for r in rank_results:
            out.setdefault(r["case"], []).append(r)
    return out


@pytest.mark.parametrize("form", ["strings", "conversational"])
def test_validation_at_step_0_equals_trl(results_1, assets, form):
    """DPO loss, rewards and log-probabilities of held-out pairs before any update: mdtk (the
    megatron-core model, its reference model, the trainer's validation) vs TRL's DPOTrainer."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from toolkit.train.data import load_tokenizer

    rows = [json.loads(line) for line in Path(assets[f"val_{form}"]).read_text().splitlines()]
    load = AutoModelForCausalLM.from_pretrained
    args = DPOConfig(output_dir=str(Path(assets["work"]) / "trl"), use_cpu=True, bf16=False,
                     report_to=[], disable_tqdm=True, beta=dc.BETA, max_length=VAL_SEQ + 1,
                     per_device_eval_batch_size=VAL_PAIRS)
    trl = DPOTrainer(model=load(assets["dense"], dtype=torch.float32),
                     ref_model=load(assets["reference"], dtype=torch.float32), args=args,
                     train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows),
                     processing_class=load_tokenizer(assets["tokenizer"])).evaluate()
    mine = results_1["validation"][form]
    assert mine["loss"] == pytest.approx(trl["eval_loss"], rel=LOSS_RTOL, abs=1e-6)
    for name in METRICS:
        rel = LOSS_RTOL if name.startswith("logps") else 0
        assert mine[name] == pytest.approx(trl[f"eval_{name}"], rel=rel, abs=1e-5), name
    assert abs(mine["rewards/margins"]) > 1e-3  # policy and reference really differ


@pytest.mark.parametrize("case", CASES_2 + CASES_4, ids=lambda c: c.name)
def test_layout_matches_single_rank(results_n, results_1, case):
    ref = {r["case"]: r for r in results_1["refs"]}[case.ref]
    ranks = results_n[case.name]
    assert len(ranks) == (4 if case in CASES_4 else 2)
    assert len(ref["losses"]) == dc.STEPS and ref["losses"][-1] < ref["losses"][0]
    for r in ranks:
        assert (r["tp"], r["pp"], r["cp"]) == (case.tp, case.pp, case.cp)
        assert r["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL, abs=0), case.name
        for mine, theirs in zip(r["metrics"], ref["metrics"], strict=True):
            for name in METRICS:
                rel = LOSS_RTOL if name.startswith("logps") else 0
                assert mine[name] == pytest.approx(theirs[name], rel=rel, abs=1e-5), name
    # metrics.jsonl holds TRL's names with the step's values
    rows = ranks[0]["records"]
    assert [row["loss"] for row in rows] == ranks[0]["losses"]
    assert [{k: row[k] for k in METRICS} for row in rows] == ranks[0]["metrics"]


def _predicted(model_dir: str, ds_config: dict, reference: bool) -> int:
    """The memory model's model states (parameters, gradients, optimizer, buffers, reference)
    for the run's DeepSpeed config: what a rank holds between backward and the update."""
    zero = memory_checks.zero_options(ds_config)
    model = model_shape_from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
    shape = TrainShape(seq_len=dc.SEQ, micro_batch=dc.MICRO, dtype="fp32", pairs=True,
                       reference_model=reference)
    return estimate(model, shape, ParallelLayout().resolve(2), zero).model_states()


def test_memory_with_and_without_precomputed_reference(results_n, assets):
    """One dp2 ZeRO-3 run: the engine's bytes plus the reference model's against the model with
    a reference model; the engine's alone (what a precomputed run holds: the same policy engine,
    no reference model) against the model without one."""
    report = []
    for rank, r in enumerate(results_n["dp2_zero3"]):
        assert r["reference_held"] > 0
        for reference, measured in ((True, r["held"] + r["reference_held"]), (False, r["held"])):
            predicted = _predicted(assets["dense"], r["ds_config"], reference)
            err = (measured - predicted) / predicted
            report.append(f"rank {rank}, reference model {reference}: engine {r['held']} + "
                          f"reference {r['reference_held'] if reference else 0} = {measured}, "
                          f"predicted {predicted} ({100 * err:+.2f}%)")
            assert abs(err) < 0.05, report[-1]
    print("\n".join(report))


def test_lora_reference_is_the_policy_with_adapters_off(results_n):
    """With LoRA the reference model is the policy's own chunks with the adapters switched off:
    no second model, and the same losses and metrics as the base checkpoint's precomputed
    log-probabilities. Step 0: the adapters start at zero (policy = reference, loss ln 2); step
    1: the trained adapters move the policy away from the reference."""
    import math

    for mine, pre in zip(results_n["lora"], results_n["lora_pre"], strict=True):
        assert mine["losses"][0] == pytest.approx(math.log(2), rel=1e-6)
        assert abs(mine["losses"][1] - math.log(2)) > 1e-4
        assert mine["losses"] == pytest.approx(pre["losses"], rel=LOSS_RTOL, abs=0)
        for a, b in zip(mine["metrics"], pre["metrics"], strict=True):
            for name in METRICS:
                rel = LOSS_RTOL if name.startswith("logps") else 0
                assert a[name] == pytest.approx(b[name], rel=rel, abs=1e-5), name
        assert mine["reference_is_policy"]


def test_dpo_after_sft_learns_the_held_out_preferences(results_1):
    """The demo model fine-tuned with the SFT example, then the DPO example: policy = reference
    at step 0 (all rewards 0, no pair won), then most held-out chosen answers win (measured
    after 16 steps: accuracies 0.646 over 48 pairs, margins 0.139)."""
    val = results_1["sft_then_dpo"]["val"]
    assert val[0]["rewards/accuracies"] == 0.0 and val[0]["rewards/margins"] == 0.0
    end = val[DPO_STEPS]
    assert end["rewards/accuracies"] > 0.6 and end["rewards/margins"] > 0.05, end
