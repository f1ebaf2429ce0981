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


def test_memory_model_kv_cache_is_what_the_static_context_allocated(generated, tiny_root):
    """GRPO's rollout KV cache (``memory.estimate``) = the bytes of the key / value tensors
    megatron-core's ``StaticInferenceContext`` allocated on each rank, at 1 rank, tp2 (kv heads
    split), pp2 (each stage its layers), tp2 x pp2, ep2 (MoE) and Gemma 3 (sliding layers)."""
    import re

    from toolkit.adapters.spec import ModelSpec
    from toolkit.memory import TrainShape, ZeroOptions, estimate
    from toolkit.memory.estimate import kv_cache_bytes
    from toolkit.memory.states import rank_params
    from toolkit.parallel import ParallelLayout

    seen = 0
    for key, per_rank in _cases(generated):
        family, knobs = key.split(":")
        layout_args = {k: int(v) for k, v in re.findall(r"([a-z]+)(\d+)", knobs)}
        layout = ParallelLayout(**layout_args).resolve(len(per_rank))
        shape = ModelSpec.of(tiny_root / family).shape
        train = TrainShape(seq_len=gc.MAX_SEQ - 1, micro_batch=gc.MAX_BATCH,
                           global_batch=gc.MAX_BATCH * layout.dp, dtype="fp32", grpo=True,
                           rollout_cache=True)
        for stage, measured in (r["kv_cache"] for r in per_rank):
            layers = rank_params(shape, layout, stage).layers
            assert measured > 0 and kv_cache_bytes(shape, layers, layout.tp, gc.MAX_BATCH,
                                                   gc.MAX_SEQ, "fp32") == measured, key
            est = estimate(shape, train, layout, ZeroOptions(stage=0), pipeline_stage=stage)
            item = [i for i in est.items if i.what.startswith("rollout KV cache")]
            assert [i.bytes for i in item] == [measured], (key, item)
            seen += 1
    assert seen == 1 + 2 * 5 + 4


def test_lm_eval_at_tp2_scores_as_lm_evals_hf_model(demo_model, rank_pool_2):
    import lm_eval
    from lm_eval.tasks import TaskManager

    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={demo_model},dtype=float32",
                                  tasks=TASKS, device="cpu", log_samples=True,
                                  task_manager=TaskManager(include_path=INCLUDE,
                                                           include_defaults=False))
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


@pytest.fixture(scope="module")
def cli_runs(trainer_assets, rank_pool_1, rank_pool_2):
    assets, root = trainer_assets
    work = str(root / "generate_cli")
    (single,) = rank_pool_1.run(gc.cli_sources, assets, work, timeout=600)
    single["two"] = rank_pool_2.run(gc.cli_two_ranks, assets, work, timeout=300)
    return assets, root / "generate_cli", single


def _hf_rows(model, tokenizer_path: str) -> list[tuple[list[int], str]]:
    """transformers' greedy completions of gc.PROMPT_ROWS (chats through the tokenizer's
    template), with the model's own generation config (its eos)."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tokenizer_path)
    out = []
    for row in gc.PROMPT_ROWS:
        ids = (tok(row["prompt"]).input_ids if "prompt" in row else tok.apply_chat_template(
            row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False))
        new = model.generate(torch.tensor([ids]), max_new_tokens=gc.CLI_NEW, do_sample=False,
                             pad_token_id=model.config.eos_token_id)[0, len(ids):].tolist()
        eos = model.generation_config.eos_token_id
        out.append((new, "eos" if new and new[-1] == eos else "length"))
    return out


def test_cli_generate_from_every_source_equals_transformers(cli_runs):
    """An HF folder, a converted megatron-core checkpoint, a full run's checkpoint root, a LoRA
    run's step folder (adapters applied on the base) and its PEFT folder: each greedy output
    equals transformers' generate on the matching HF model (PEFT's loader for the adapters)."""
    import transformers as tf
    from peft import PeftModel

    assets, work, single = cli_runs
    rows = single["rows"]

    def load(path):
        return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    base = _hf_rows(load(assets["dense"]), assets["tokenizer"])
    peft = PeftModel.from_pretrained(load(assets["dense"]), str(work / "lora_peft")).eval()
    two = single["two"]  # `mdtk generate --tp 2` on 2 ranks: the 1-rank rows
    assert two[0]["tp2"] == two[1]["tp2"] == rows["hf"]
    tok = assets["tokenizer"]
    refs = {"hf": base, "mcore": base, "full": _hf_rows(load(work / "full_hf"), tok),
            "lora": _hf_rows(load(work / "lora_hf"), tok), "peft": _hf_rows(peft, tok)}
    assert refs["full"] != base and refs["lora"] != base  # the runs changed the model
    for name, ref in refs.items():
        got = [(r["completion_ids"], r["finish_reason"]) for r in rows[name]]
        assert got == ref, (name, got, ref)
        assert [r["prompt"][:10] for r in rows[name]][:2] == ["the cat sa", "a"]
        assert all(isinstance(r["completion"], str) for r in rows[name])


def test_cli_refuses_bad_input_with_one_error_and_writes_nothing(cli_runs):
    _, work, single = cli_runs
    r = single["refusals"]
    assert all(not written for _, written in r.values()), r
    assert f"{work / 'bad.jsonl'}:2: not JSON" in r["bad_line"][0]
    assert "max_position_embeddings" in r["too_long"][0] and "long.jsonl:1" in r["too_long"][0]
    assert "unknown lm-eval task(s) no_such_task" in r["unknown_task"][0]
    assert "mdtk launch -n 2" in r["layout"][0]
    first = single["two"][0]["ep2"][0]
    for err, written in (r["ep2"] for r in single["two"]):  # every rank: the same error
        assert not written and err == first
        assert "expert" in err.lower() and "ep" in err, err
