"""Rank functions of tests/test_generate.py: mdtk's generation engine (megatron-core's static
batch, ``toolkit.infer.engine``) and its lm-eval model (``toolkit.infer.lm``) on tiny HF models
loaded at a layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

NEW = 10  # tokens generated per prompt
EOS = 2  # the tiny configs' eos_token_id (tests/dist_checks/adapter_checks.py)


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
    return Generator(chunks, eos_ids=[EOS], vocab_size=adapter.dims.vocab, max_seq_len=32,
                     max_batch=4)


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
                                  task_manager=TaskManager(include_path=include))
    parallel.destroy()
    if res is None:
        return None
    return {"results": res["results"],
            "samples": {t: [s["resps"] for s in res["samples"][t]] for t in tasks}}
