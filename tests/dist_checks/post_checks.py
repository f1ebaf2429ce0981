"""Rank functions for the post-training checks (``toolkit.train.trainer.run`` with ``data.mode``
reward, kto, distill, and dpo with the reference-free ORPO and SimPO losses).

Every objective trains the trainer tests' tiny Llama (the reward model: its HF
sequence-classification folder, a score head drawn by transformers, so TRL starts from the same
weights; the distillation teacher: a Llama twice the student's size with its vocabulary) for
``STEPS`` steps on ``ROWS`` rows in order, validating before and after, so that the same run is
compared with TRL's trainer (tests/test_trainer_post.py) and is the reference of its layouts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STEPS, MICRO, GLOBAL, SEQ, LR = 3, 2, 4, 48, 1e-3
ROWS, VAL_ROWS = GLOBAL * STEPS, 8
#: each objective's data file (bundled) and settings, TRL's names (tests/test_trainer_post.py
#: gives TRL's trainers the same values)
OBJECTIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("dpo_text.jsonl", ("data.mode=reward",)),
    "orpo": ("dpo_text.jsonl", ("data.mode=dpo", "dpo.loss=orpo", "dpo.beta=0.1")),
    "simpo": ("dpo_text.jsonl", ("data.mode=dpo", "dpo.loss=simpo", "dpo.beta=2.0",
                                 "dpo.simpo_gamma=0.5", "dpo.cpo_alpha=0.5")),
    "kto": ("kto.jsonl", ("data.mode=kto", "kto.beta=0.1", "kto.desirable_weight=1.0",
                          "kto.undesirable_weight=1.5")),
    "distill": ("sft.jsonl", ("data.mode=distill", "distill.beta=0.5")),
}


@dataclass(frozen=True)
class PostCase:
    """One run of an objective: its layout, and what else to return."""

    objective: str
    name: str = ""
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    sp: bool = False
    zero: int = 1
    model: str = ""  # another base model (``assets`` key): the tied reward model
    overrides: tuple[str, ...] = field(default=())
    memory: bool = False  # the bytes each rank holds before the first update

    @property
    def label(self) -> str:
        return self.name or self.objective


def _fits(row: dict[str, Any]) -> bool:
    """SFT rows for distillation: conversations short enough to fit seq_len + 1 whole (GKD keeps
    a long row's end, mdtk its start)."""
    return "messages" in row and len(json.dumps(row)) < 200


def make_post_assets(base: dict[str, str], root: Path) -> dict[str, str]:
    """The reward model's sequence-classification folder, the teacher, and each objective's
    training and validation rows (in the test process, without mdtk's CPU mode)."""
    import transformers as tf

    from toolkit import bundled

    out = dict(base)
    torch.manual_seed(3)  # the score head transformers draws
    seqcls = tf.AutoModelForSequenceClassification.from_pretrained(base["dense"], num_labels=1,
                                                                   dtype=torch.float32)
    seqcls.config.pad_token_id = 1
    seqcls.save_pretrained(root / "seqcls")
    config = tf.AutoConfig.from_pretrained(base["dense"])
    config.num_hidden_layers = 10  # twice the student's parameters, the same vocabulary
    torch.manual_seed(5)
    teacher = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in teacher.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    teacher.save_pretrained(root / "teacher")
    out.update(seqcls=str(root / "seqcls"), teacher=str(root / "teacher"))
    for objective, (file, _) in OBJECTIVES.items():
        lines = bundled.path(f"bundled:examples/data/{file}").read_text().splitlines()
        rows = [r for r in map(json.loads, lines) if objective != "distill" or _fits(r)]
        for split, part in (("train", rows[:ROWS]), ("val", rows[-VAL_ROWS:])):
            path = root / f"{objective}_{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in part))
            out[f"{objective}_{split}"] = str(path)
    return out


def config(case: PostCase, assets: dict[str, str], out: Path):
    """The trainer tests' config (fp32, constant LR, ``trainer_checks.config``) on this
    objective's rows in order, validated before the first step and after the last."""
    from dist_checks import trainer_checks as tc

    objective = case.objective
    model = case.model or ("seqcls" if objective == "reward" else "dense")
    settings = (*OBJECTIVES[objective][1], f"data.sources=[{assets[objective + '_train']}]",
                f"data.validation_sources=[{assets[objective + '_val']}]",
                "data.shuffle=false", f"train.eval_interval={STEPS}",
                f"train.micro_batch={MICRO}", f"train.global_batch={GLOBAL}",
                f"train.seq_len={SEQ}", f"optim.lr={LR}", f"model.path={assets[model]}",
                *((f"distill.teacher={assets['teacher']}",) if objective == "distill" else ()),
                *case.overrides)
    base = tc.Case(case.label, tp=case.tp, pp=case.pp, vpp=case.vpp, cp=case.cp, sp=case.sp,
                   zero=case.zero, steps=STEPS, overrides=settings)
    return tc.config(base, assets, out)


def run_case(case: PostCase, assets: dict[str, str], workdir: str) -> dict[str, Any]:
    """Train ``case``: its losses, metrics and validations, metrics.jsonl (rank 0), the export,
    and (``memory``) the bytes this rank's engine and frozen model hold."""
    from dist_checks.dpo_checks import run_spied, spy_engine
    from toolkit.train import trainer

    out = Path(workdir) / case.label
    seen: dict[str, Any] = {}
    make_objective = trainer.objective_for
    engine_spy = spy_engine(seen, "frozen_held" if case.memory else None)

    def objective_spy(setup):
        seen["objective"] = make_objective(setup)
        return seen["objective"]

    result, records = run_spied(config(case, assets, out), [
        (trainer, "build_engine", engine_spy), (trainer, "objective_for", objective_spy)])
    seen.pop("objective", None)
    return {"case": case.label, "losses": result.losses, "metrics": result.metrics,
            "val_losses": result.val_losses, "val_metrics": result.val_metrics,
            "records": records, "ds_config": result.ds_config,
            "export_dir": result.export_dir, "export_diff": result.export_max_abs_diff, **seen}


def run_cases(cases: list[PostCase], assets: dict[str, str], workdir: str) -> list[dict]:
    return [run_case(c, assets, workdir) for c in cases]
