"""Benchmark scripts' GPU code paths run on gloo ranks with tiny shapes, so an API change that
breaks them shows in CI, not first in a rare GPU window (the H100 run found bench_train's bare
loop calling ``build_model`` with its old signature)."""

from __future__ import annotations

import time

from dist_checks import load_script


def bench_train_compare(assets: dict[str, str], root: str) -> dict:
    """bench_train's ``compare`` (bare megatron-core loop, then the trainer) and ``summarize``,
    the GPU part's code minus the device: dp over the pool's ranks, fp32, a few steps."""
    start = time.perf_counter()
    bt = load_script("bench_train")
    opts = {"rounds": 1, "train": dict(layout={"tp": 1}, steps=bt.WARMUP + 2, seq=32, micro=2,
                                       global_batch=4, precision="fp32")}
    res = bt.compare({**assets, "root": root}, opts)
    summary = bt.summarize(res) if res["trainer"] else {}  # rank 0 times the trainer
    return {**summary, "bare": res["bare"], "trainer": res["trainer"],
            "job_s": time.perf_counter() - start}
