"""Rank functions: ``mdtk train`` (the real trainer) on Megatron indexed datasets: a blend of a
prefix written as Megatron-LM's preprocess_data.py writes it (megatron-core's tokenizer and
IndexedDatasetBuilder) and one written by DeepSpeed's builder (its dtype code 6 = uint16),
weighted 0.25 / 0.75; stopped at step 3 and resumed at other layouts; and a prefix whose token
ids the model's vocab cannot hold, refused before any process group or file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dist_checks.trainer_checks import Case, refusal, run_case

STEPS = 6
WEIGHTS = (0.25, 0.75)


def make_prefixes(root: Path, tokenizer: str, corpus: Path) -> dict[str, str]:
    """Built in the test process: A (megatron-core's way), B (DeepSpeed's builder), and BAD
    (ids up to 600, above the dense model's vocab of 512)."""
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import (
        MMapIndexedDatasetBuilder,
    )
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from megatron.core.tokenizers import MegatronTokenizer

    root.mkdir(parents=True, exist_ok=True)
    tok = MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer,
                                            metadata_path={"library": "huggingface"})
    texts = [json.loads(x)["text"] for x in corpus.read_text().splitlines()]
    half = len(texts) // 2
    a = IndexedDatasetBuilder(str(root / "a.bin"), dtype=DType.optimal_dtype(tok.vocab_size))
    for t in texts[:half]:
        ids = tok.tokenize(t) + [tok.eod]
        a.add_document(ids, [len(ids)])
    a.finalize(str(root / "a.idx"))
    b = MMapIndexedDatasetBuilder(str(root / "b.bin"), dtype=np.uint16)
    for t in texts[half:]:
        b.add_item_numpy(np.array(tok.tokenize(t) + [tok.eod], dtype=np.uint16))
        b.end_document()
    b.finalize(str(root / "b.idx"))
    bad = IndexedDatasetBuilder(str(root / "bad.bin"), dtype=np.uint16)
    ids = np.random.default_rng(0).integers(0, 601, 4000)
    ids[17] = 600
    bad.add_document(ids, [len(ids)])
    bad.finalize(str(root / "bad.idx"))
    return {"a": str(root / "a"), "b": str(root / "b"), "bad": str(root / "bad")}


def _data(prefixes: dict[str, str], *more: str) -> tuple[str, ...]:
    return (f"data.sources=[{prefixes['a']},{prefixes['b']}]",
            f"data.weights=[{WEIGHTS[0]},{WEIGHTS[1]}]", *more)


def _with_metrics(case: Case, assets: dict[str, str], workdir: str) -> dict[str, Any]:
    out = run_case(case, assets, workdir)
    path = Path(workdir) / case.name / "metrics.jsonl"
    if path.is_file():
        out["rows"] = [json.loads(x) for x in path.read_text().splitlines()]
    return out


def two_rank_runs(assets: dict[str, str], workdir: str, prefixes: dict[str, str],
                  ) -> dict[str, Any]:
    """dp2: 6 steps straight; 3 steps + checkpoint; that checkpoint resumed at tp2; a refusal."""
    full = _with_metrics(Case("idx_dp2_full", zero=2, steps=STEPS,
                              overrides=_data(prefixes)), assets, workdir)
    stop = _data(prefixes, "checkpoint.interval=3", "checkpoint.resume=auto")
    first = run_case(Case("idx_dp2_stop3", zero=2, steps=3, overrides=stop), assets, workdir)
    ckpt = Path(workdir) / "idx_dp2_stop3" / "checkpoints" / "step_0000003"
    tp2 = run_case(Case("idx_tp2_resumed", tp=2, zero=2, steps=STEPS,
                        overrides=_data(prefixes, f"checkpoint.resume={ckpt}")), assets, workdir)
    bad = refusal(Case("idx_bad_ids", overrides=(f"data.sources=[{prefixes['bad']}]",)),
                  assets, workdir)
    bad["written"] = sorted(p.name for p in (Path(workdir) / "idx_bad_ids").glob("*")) \
        if (Path(workdir) / "idx_bad_ids").exists() else []
    return {"full": full, "first": first, "tp2": tp2, "bad": bad, "checkpoint": str(ckpt)}


def one_rank_resume(assets: dict[str, str], workdir: str, prefixes: dict[str, str],
                    checkpoint: str) -> dict[str, Any]:
    """dp2's step-3 checkpoint resumed on one rank (dp1)."""
    return run_case(Case("idx_dp1_resumed", zero=2, steps=STEPS,
                         overrides=_data(prefixes, f"checkpoint.resume={checkpoint}")),
                    assets, workdir)
