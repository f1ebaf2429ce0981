"""Training on Alpaca and ShareGPT files lowers the validation loss: the real trainer
(``toolkit.train.trainer.run``) on the session's 2-rank pool, one pool call for all runs.

The files are the bundled SFT data rewritten: its prompt/response rows as Alpaca (half with the
question moved to ``input``, half with an empty input), its chat rows as ShareGPT (system turns
and two-exchange conversations included). The row masks themselves are checked by hand in
tests/test_train_data.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dist_checks import trainer_checks as tc
from dist_checks.trainer_checks import Case

from toolkit import bundled

STEPS = 8
SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}


def write_format_files(folder: Path) -> dict[str, str]:
    data = bundled.path(bundled.DATA) / "sft.jsonl"
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    alpaca, sharegpt = [], []
    for r in rows:
        if r.get("messages"):
            sharegpt.append({"conversations": [{"from": SHAREGPT_FROM[m["role"]],
                                                "value": m["content"]} for m in r["messages"]]})
        elif len(alpaca) % 2:
            alpaca.append({"instruction": "Answer the question.", "input": r["prompt"],
                           "output": r["response"]})
        else:
            alpaca.append({"instruction": r["prompt"], "input": "", "output": r["response"]})
    out = {}
    for name, data in (("alpaca", alpaca), ("sharegpt", sharegpt)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
        out[name] = str(path)
    return out


def train_formats(cases: list[Case], assets: dict[str, str], workdir: str) -> dict[str, Any]:
    """Rank function: each case trained with the real trainer; its validation losses."""
    from toolkit.train import trainer

    out = {}
    for case in cases:
        result = trainer.run(tc.config(case, assets, Path(workdir) / case.name, mode="sft"))
        out[case.name] = {"val": result.val_losses, "losses": result.losses}
    return out


@pytest.fixture(scope="module")
def results(rank_pool_2, trainer_assets):
    assets, root = trainer_assets
    files = write_format_files(root)
    common = ("data.validation_split=0.1", f"train.eval_interval={STEPS}", "train.seq_len=64")
    alpaca, sharegpt = (f"data.sources={json.dumps([files[k]])}" for k in ("alpaca", "sharegpt"))
    cases = [  # alpaca detected from its keys; sharegpt named by data.format
        Case("alpaca", steps=STEPS, overrides=(alpaca, *common)),
        # without the chat template: the Stanford Alpaca prompt (longer, so a longer sequence)
        Case("alpaca_plain", steps=STEPS, overrides=(alpaca, "data.template=plain", *common,
                                                     "train.seq_len=160")),
        Case("sharegpt", steps=STEPS, overrides=(sharegpt, "data.format=sharegpt", *common)),
    ]
    return rank_pool_2.run(train_formats, cases, assets, str(root / "runs"), timeout=600)


@pytest.mark.parametrize("fmt", ["alpaca", "alpaca_plain", "sharegpt"])
def test_training_lowers_validation_loss(results, fmt):
    first, second = (r[fmt] for r in results)
    assert first == second  # both ranks report the same losses
    val = first["val"]
    assert sorted(val) == [0, STEPS]
    assert val[STEPS] < val[0] - 1.0, val
