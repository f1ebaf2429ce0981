"""The house rules of issue 36, read from the code as the issue states them: one owner for the
model description, the trainer without a branch for what it trains, typed glue."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = [p for d in ("toolkit", "model_adapters") for p in (ROOT / d).rglob("*.py")]


def _code_lines(path: Path) -> list[str]:
    """The module's lines outside docstrings and comments (strings in code stay)."""
    text = re.sub(r'"""(?:.|\n)*?"""', '""', path.read_text())
    return [line.split("#")[0] for line in text.splitlines()]


def _holders(pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return sorted(str(p.relative_to(ROOT)) for p in CODE
                  if any(rx.search(line) for line in _code_lines(p)))


def test_config_json_is_named_and_read_in_one_module():
    # the file name in code (opening, joining, detecting) lives in one module; everything else
    # asks the model description (toolkit/adapters/spec.py) through it
    assert _holders(r"""["']config\.json["']""") == ["toolkit/checkpoint/hf.py"]
    # transformers' config object of a model is made in that module too (AutoConfig's table)
    assert _holders(r"AutoConfig\.|CONFIG_MAPPING") == ["toolkit/adapters/spec.py"]


def test_the_trainer_has_no_branch_for_what_it_trains():
    text = (ROOT / "toolkit/train/trainer.py").read_text().lower()
    assert "lora" not in text and "peft" not in text


def test_the_run_state_is_typed():
    from toolkit.train.run_state import RunState

    annotations = {f.name: str(f.type) for f in dataclasses.fields(RunState)}
    assert "variant" in annotations and "objective" in annotations
    loose = [name for name, tp in annotations.items() if tp in ("Any", "typing.Any")]
    assert not loose, loose


def test_the_test_map_names_every_test_file():
    text = (ROOT / "tests" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "tests").glob("test_*.py")) if p.name not in text]
    assert not missing, f"tests/README.md does not name {missing}: add them to its table"
