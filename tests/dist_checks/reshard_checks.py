"""Rank functions for layout-invariant initialization and resume at another layout.

Every run pretrains from an HF *config* (random init, ``toolkit.train.init``) with the real
trainer. Right after the model is built each run gathers its initial weights into an HF folder
(``export_hf``, before the engine touches them), so the test process can compare the weights of
every layout tensor by tensor. Checkpoints written at one layout are resumed at another; the
losses of the following steps must equal the uninterrupted single-rank run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dist_checks import trainer_checks as tc
from dist_checks.trainer_checks import Case

STOP = 3  # producers stop (and checkpoint) here; resumed runs continue to tc.STEPS + 1
FULL = 6


def _from_config(case: Case, assets: dict[str, str]) -> Case:
    conf = str(Path(assets[case.model]) / "config.json")
    # Adam eps 1e-6, not 1e-8: an embedding row first seen at a step takes the update
    # lr * g / (|g| + eps); an element with |g| near a tiny eps turns the legitimate fp32 rounding
    # of another layout's backward (tp2 x pp2: embedding[288, 26] at step 3) into a 30% change
    return Case(**{**case.__dict__, "overrides": ("model.path=null", f"model.config={conf}",
                                                  "optim.eps=1e-6", *case.overrides)})


def ckpt(workdir: str, name: str, step: int = STOP) -> str:
    return str(Path(workdir) / name / "checkpoints" / f"step_{step:07d}")


def producer(name: str, **kw: Any) -> Case:
    return Case(name, steps=STOP, overrides=(f"checkpoint.interval={STOP}",), **kw)


def resumed(name: str, source: str, workdir: str, **kw: Any) -> Case:
    return Case(name, steps=FULL, overrides=(f"checkpoint.resume={ckpt(workdir, source)}",),
                **kw)


def run(case: Case, assets: dict[str, str], workdir: str) -> dict[str, Any]:
    """``tc.run_case`` from the config, exporting the initial weights to ``<case>/init_hf``."""
    from toolkit.adapters.live import export_hf
    from toolkit.train import trainer

    original = trainer.build_model
    init_dir = Path(workdir) / case.name / "init_hf"

    def spy(*args):
        chunks, adapter = original(*args)
        export_hf(chunks, adapter, init_dir, overwrite=True)
        return chunks, adapter

    trainer.build_model = spy
    try:
        out = tc.run_case(_from_config(case, assets), assets, workdir)
    finally:
        trainer.build_model = original
    return {**out, "init_hf": str(init_dir)}


def runs(cases: list[Case], assets: dict[str, str], workdir: str) -> list[dict[str, Any]]:
    return [run(c, assets, workdir) for c in cases]
