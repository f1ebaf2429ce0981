"""mdtk's bundled reward functions (``grpo.rewards: [{function: "mdtk:NAME"}]``), with TRL's
signature ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``."""

from __future__ import annotations

import re
from typing import Any


def _text(completion: Any) -> str:
    """A completion's text (a conversational completion: its assistant turn's content)."""
    if isinstance(completion, list):
        return "".join(str(turn.get("content", "")) for turn in completion)
    return str(completion)


def format_regex(prompts: list, completions: list, completion_ids: list, *, pattern: str,
                 **columns: Any) -> list[float]:
    """1.0 where the completion contains a match of ``pattern`` (``re.search``, DOTALL)."""
    rx = re.compile(pattern, re.DOTALL)
    return [1.0 if rx.search(_text(c)) else 0.0 for c in completions]


def answer_prefix(prompts: list, completions: list, completion_ids: list, *,
                  column: str = "answer", **columns: Any) -> list[float]:
    """1.0 where the completion, stripped, starts with the row's ``column`` (e.g. the answer of
    an arithmetic prompt); None (unscored) for rows without one."""
    answers = columns.get(column)
    if answers is None:
        raise ValueError(f"mdtk:answer_prefix reads the rows' {column!r} column; the data has "
                         f"{sorted(columns)}.")
    return [None if a is None else float(_text(c).strip().startswith(str(a).strip()))
            for c, a in zip(completions, answers, strict=True)]


BUILTIN = {"format_regex": format_regex, "answer_prefix": answer_prefix}
