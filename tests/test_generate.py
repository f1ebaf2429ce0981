"""Generation and evaluation on the sharded model (issue 37): megatron-core's static batch
through ``toolkit.infer.engine`` equals ``transformers.generate`` token for token (greedy, fp32,
CPU) at every layout, for prompts of different lengths in one batch; sampling with a seed is
the same at 1 rank and tp2; lm-eval on the sharded model (``toolkit.infer.lm``) scores as
lm-eval's own ``hf`` model."""

from __future__ import annotations

import pytest
import torch
from dist_checks import generate_checks as gc

INCLUDE = "toolkit/bundled/examples/eval"  # the bundled tasks (local data, offline)
TASKS = ["mdtk_arithmetic", "mdtk_sentences"]


def _hf_greedy(path) -> list[tuple[list[int], str]]:
    """transformers' own greedy completions, one prompt at a time: (ids after the prompt,
    finish reason)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in gc.prompts():
        ids = model.generate(torch.tensor([p]), max_new_tokens=gc.NEW, do_sample=False,
                             eos_token_id=gc.EOS, pad_token_id=gc.EOS)[0, len(p):].tolist()
        out.append((ids, "eos" if gc.EOS in ids else "length"))
    return out


@pytest.fixture(scope="module")
def references(tiny_root):
    return {f: _hf_greedy(tiny_root / f) for f in ("llama", "gemma3", "phi3", "mixtral")}


@pytest.fixture(scope="module")
def generated(tiny_root, rank_pool_1, rank_pool_2, rank_pool_4):
    root = str(tiny_root)
    single = rank_pool_1.run(gc.generate_families, root, [("llama", {})], (5,), timeout=300)
    two = rank_pool_2.run(gc.generate_families, root, [
        ("llama", {"tp": 2}), ("llama", {"pp": 2}), ("gemma3", {"tp": 2}), ("phi3", {"pp": 2}),
        ("mixtral", {"ep": 2})], (5,), timeout=600)
    four = rank_pool_4.run(gc.generate_families, root, [("llama", {"tp": 2, "pp": 2})],
                           timeout=300)
    return {"single": single, "two": two, "four": four}


def _cases(generated):
    for ranks in generated.values():
        for key in ranks[0]:
            if key != "single":
                yield key, [r[key] for r in ranks]


def test_greedy_equals_transformers_generate_at_every_layout(generated, references):
    seen = set()
    for key, per_rank in _cases(generated):
        family = key.split(":")[0]
        for r in per_rank:  # every rank returns the same completions
            assert r["greedy"] == per_rank[0]["greedy"], key
        got = [(ids, why) for ids, why in per_rank[0]["greedy"]]
        assert got == references[family], (key, got, references[family])
        seen.add(key)
    assert seen == {"llama:", "llama:tp2", "llama:pp2", "gemma3:tp2", "phi3:pp2", "mixtral:ep2",
                    "llama:pp2,tp2"}
    # the batch mixes lengths (7, 3, 12, 5); some end at the eos, some at the length
    assert {why for _, why in references["llama"]} | {
        why for f in references for _, why in references[f]} >= {"length"}


def test_prompts_batched_equal_prompts_one_by_one(generated, references):
    single = generated["single"][0]["single"]
    assert single == [ids for ids, _ in references["llama"]]


def test_sampling_with_a_seed_is_the_same_at_1_rank_and_tp2(generated):
    one = generated["single"][0]["llama:"]["seed5"]
    tp2 = [r["llama:tp2"]["seed5"] for r in generated["two"]]
    assert tp2[0] == tp2[1] == one
    greedy = [ids for ids, _ in generated["single"][0]["llama:"]["greedy"]]
    assert one != greedy  # it did sample (temperature 0.9 over a random model's flat logits)


def test_lm_eval_at_tp2_scores_as_lm_evals_hf_model(demo_model, rank_pool_2):
    import lm_eval
    from lm_eval.tasks import TaskManager

    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={demo_model},dtype=float32",
                                  tasks=TASKS, device="cpu", log_samples=True,
                                  task_manager=TaskManager(include_path=INCLUDE))
    mine, other = rank_pool_2.run(gc.evaluate_tasks, str(demo_model.parent), demo_model.name,
                                  {"tp": 2}, TASKS, INCLUDE, timeout=600)
    assert other is None  # lm-eval returns results on rank 0 only
    acc = ref["results"]["mdtk_arithmetic"]
    assert mine["results"]["mdtk_arithmetic"]["acc,none"] == acc["acc,none"]
    assert mine["results"]["mdtk_arithmetic"]["acc_norm,none"] == acc["acc_norm,none"]
    assert mine["results"]["mdtk_sentences"]["word_perplexity,none"] == pytest.approx(
        ref["results"]["mdtk_sentences"]["word_perplexity,none"], rel=1e-4)
    for task in TASKS:
        theirs = [s["resps"] for s in ref["samples"][task]]
        assert len(mine["samples"][task]) == len(theirs) > 0
        for a, b in zip(mine["samples"][task], theirs, strict=True):
            va = [float(x[0][0] if isinstance(x[0], (list, tuple)) else x[0]) for x in a]
            vb = [float(x[0][0] if isinstance(x[0], (list, tuple)) else x[0]) for x in b]
            assert va == pytest.approx(vb, abs=1e-4), task
