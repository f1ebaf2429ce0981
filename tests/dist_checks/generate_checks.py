"""Rank functions of tests/test_generate.py: mdtk's generation engine (megatron-core's static
batch, ``toolkit.infer.engine``) and its lm-eval model (``toolkit.infer.lm``) on tiny HF models
loaded at a layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

NEW = 10  # tokens generated per prompt
EOS = 2  # the tiny configs' eos_token_id (tests/dist_checks/adapter_checks.py)
MAX_SEQ, MAX_BATCH = 32, 4  # the engine's static batch: tokens and prompts its KV cache holds


def prompts() -> list[list[int]]:
    """Prompts of different lengths (one batch holds them all)."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (7, 3, 12, 5)]


def _generator(root: Path, family: str, layout: dict[str, Any]):
    from toolkit import parallel
    from toolkit.adapters import live
    from toolkit.infer.engine import Generator
    from toolkit.parallel import ParallelLayout

    parallel.destroy()
    chunks, adapter = live.load_hf(root / family, ParallelLayout(**layout), dtype=torch.float32)
    return Generator(chunks, eos_ids=[EOS], vocab_size=adapter.dims.vocab, max_seq_len=MAX_SEQ,
                     max_batch=MAX_BATCH)


def kv_cache(gen) -> tuple[int, int]:
    """(this rank's pipeline stage, bytes of the KV cache its static context allocated): the
    tensors megatron-core keeps in ``StaticInferenceContext.key_value_memory_dict``."""
    from megatron.core import parallel_state as ps

    held = gen.wrapped.inference_context.key_value_memory_dict.values()
    return (ps.get_pipeline_model_parallel_rank(),
            sum(t.numel() * t.element_size() for kv in held for t in kv))


def generate_families(root: str, cases: list[tuple[str, dict[str, Any]]],
                      seeds: tuple[int, ...] = ()) -> dict[str, Any]:
    """Per (family, layout) case: the greedy completions of ``prompts()`` in one batch, the same
    prompts one by one (first case only), and sampled completions (temperature 0.9, top_k 50) for
    each seed. Every rank returns what it got."""
    from toolkit import parallel
    from toolkit.infer.engine import Sampling

    out: dict[str, Any] = {}
    for family, layout in cases:
        gen = _generator(Path(root), family, layout)
        key = f"{family}:" + ",".join(f"{k}{v}" for k, v in sorted(layout.items()))
        batch = gen.generate(prompts(), Sampling(max_new_tokens=NEW))
        out[key] = {"greedy": [(c.completion_ids, c.finish_reason) for c in batch]}
        if not out.get("single"):
            out["single"] = [gen.generate([p], Sampling(max_new_tokens=NEW))[0].completion_ids
                             for p in prompts()]
        for seed in seeds:
            sampled = gen.generate(prompts(), Sampling(max_new_tokens=NEW, temperature=0.9,
                                                       top_k=50, seed=seed), logprobs=True)
            out[key][f"seed{seed}"] = [c.completion_ids for c in sampled]
        out[key]["kv_cache"] = kv_cache(gen)
        parallel.destroy()
    return out


def evaluate_tasks(root: str, model: str, layout: dict[str, Any], tasks: list[str],
                   include: str) -> dict[str, Any] | None:
    """lm-eval's ``simple_evaluate`` with mdtk's sharded LM (rank 0 gets the results: lm-eval
    returns them on LOCAL_RANK 0 only): the results and every sample's responses."""
    import lm_eval
    import transformers as tf
    from lm_eval.tasks import TaskManager

    from toolkit import parallel
    from toolkit.adapters import live
    from toolkit.infer.lm import ShardedLM
    from toolkit.parallel import ParallelLayout

    parallel.destroy()
    path = Path(root) / model
    chunks, adapter = live.load_hf(path, ParallelLayout(**layout), dtype=torch.float32)
    lm = ShardedLM(chunks, tf.AutoTokenizer.from_pretrained(path), adapter.hf_config,
                   vocab_size=adapter.dims.vocab)
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, log_samples=True,
                                  task_manager=TaskManager(include_path=include,
                                                           include_defaults=False))
    parallel.destroy()
    if res is None:
        return None
    return {"results": res["results"],
            "samples": {t: [s["resps"] for s in res["samples"][t]] for t in tasks}}


# -- the commands, through the CLI ---------------------------------------------------------------

PROMPT_ROWS = [{"prompt": "the cat sat on the mat"}, {"prompt": "a"},
               {"messages": [{"role": "user", "content": "tell me a story about the sea"}]}]
CLI_NEW = 8


def _cli(*args: str) -> str | None:
    """``mdtk ARGS`` in this process (typer's parsing, errors raised): the UserError's text,
    or None when the command succeeded."""
    from toolkit.cli import app
    from toolkit.errors import UserError

    try:
        app(list(args), standalone_mode=False)
    except UserError as e:
        return str(e)
    return None


def _generate(model: str, out: Path, prompts: Path, tokenizer: str, *more: str) -> list[dict]:
    err = _cli("generate", model, "--prompts", str(prompts), "--out", str(out),
               "--max-new-tokens", str(CLI_NEW), "--tokenizer", tokenizer, "--batch-size", "2",
               *more)
    assert err is None, err
    import json

    return [json.loads(line) for line in out.read_text().splitlines()]


def cli_sources(assets: dict[str, str], work: str) -> dict[str, Any]:
    """One rank: a 2-step full run and a 2-step LoRA run (each saving its checkpoint and
    exporting HF), ``mdtk convert`` of the base to megatron-core, then ``mdtk generate`` from
    the HF folder, the converted checkpoint, both runs' checkpoints and the LoRA run's PEFT
    folder; and the refusals of bad input (the error, and whether --out was written)."""
    import json

    from dist_checks import trainer_checks as tc

    root = Path(work)
    root.mkdir(parents=True, exist_ok=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPT_ROWS))
    keep = ("checkpoint.interval=2", "checkpoint.keep_last=1")
    tc.run_case(tc.Case("gen_full", steps=2, overrides=(*keep, f"export.hf_dir={root}/full_hf")),
                assets, work)
    tc.run_case(tc.Case("gen_lora", steps=2, overrides=(
        *keep, "peft.method=lora", "peft.r=4", "peft.alpha=8", f"export.hf_dir={root}/lora_hf",
        f"export.adapter_dir={root}/lora_peft")), assets, work)
    assert _cli("convert", assets["dense"], str(root / "mcore"), "--to", "mcore") is None
    tok = assets["tokenizer"]
    sources = {"hf": assets["dense"], "mcore": str(root / "mcore"),
               "full": str(root / "gen_full" / "checkpoints"),
               "lora": str(root / "gen_lora" / "checkpoints" / "step_0000002"),
               "peft": str(root / "lora_peft")}
    out: dict[str, Any] = {"rows": {k: _generate(v, root / f"{k}.jsonl", prompts, tok)
                                    for k, v in sources.items()},
                           "refusals": _refusals(assets, root, prompts)}
    return out


def _refusals(assets: dict[str, str], root: Path, prompts: Path) -> dict[str, tuple]:
    bad = root / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "cut\n')
    long = root / "long.jsonl"
    long.write_text('{"prompt": "' + "the cat " * 200 + '"}\n')
    tok, dense = assets["tokenizer"], assets["dense"]
    runs = {
        "bad_line": ("generate", dense, "--prompts", str(bad)),
        "too_long": ("generate", dense, "--prompts", str(long)),
        "unknown_task": ("eval", dense, "--tasks", "mdtk_arithmetic,no_such_task",
                         "--include-path", "bundled:examples/eval"),
        "layout": ("generate", dense, "--prompts", str(prompts), "--tp", "2"),
    }
    out = {}
    for name, args in runs.items():
        dst = root / f"refused_{name}.out"
        out[name] = (_cli(*args, "--out", str(dst), "--tokenizer", tok), dst.exists())
    return out


def cli_two_ranks(assets: dict[str, str], work: str) -> dict[str, Any]:
    """On 2 ranks, after ``cli_sources``: ``mdtk generate --tp 2`` of its prompts (rank 0 writes
    the rows), and ``--ep 2`` for a dense model (a layout the model cannot take: the error, and
    whether --out was written)."""
    import json

    root, tok = Path(work), assets["tokenizer"]
    _generate(assets["dense"], root / "tp2.jsonl", root / "prompts.jsonl", tok, "--tp", "2")
    rows = [json.loads(x) for x in (root / "tp2.jsonl").read_text().splitlines()]
    dst = root / "refused_ep2.jsonl"
    err = _cli("generate", assets["dense"], "--prompts", str(root / "prompts.jsonl"), "--out",
               str(dst), "--tokenizer", tok, "--ep", "2")
    return {"tp2": rows, "ep2": (err, dst.exists())}
