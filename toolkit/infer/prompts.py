"""The prompts file of ``mdtk generate``: JSON lines with ``prompt`` (text) or ``messages`` (a
chat, rendered with the tokenizer's chat template and its generation prompt), turned into token
ids; and the output rows, one per prompt in input order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.errors import UserError


class PromptsError(UserError):
    """A prompts file mdtk cannot read (the message names the file and the line)."""


@dataclass(frozen=True)
class Prompt:
    line: int  # 1-based, in the file
    text: str  # as given, or the rendered chat
    ids: list[int]


def read_prompts(path: str | Path, tokenizer: Any) -> list[Prompt]:
    """Every line of ``path`` as a tokenized prompt; PromptsError naming the line otherwise.
    Text prompts are tokenized as ``transformers`` would for ``generate`` (the tokenizer's
    special tokens, e.g. a BOS, included); chats through the chat template."""
    path = Path(path)
    if not path.is_file():
        raise PromptsError(f"prompts file {path} not found (JSON lines with 'prompt' or "
                           "'messages').")
    from toolkit.jsonl import json_rows

    out = [_prompt(row, tokenizer, where, number)
           for number, where, row in json_rows(path, PromptsError)]
    if not out:
        raise PromptsError(f"{path} holds no prompts.")
    return out


def _prompt(row: Any, tokenizer: Any, where: str, number: int) -> Prompt:
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise PromptsError(f"{where}: a row needs exactly one of 'prompt' (text) and 'messages' "
                           "(a chat), got " + (", ".join(sorted(row)) if isinstance(row, dict)
                                               else type(row).__name__) + ".")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise PromptsError(f"{where}: 'prompt' must be non-empty text.")
        return Prompt(number, row["prompt"], list(tokenizer(row["prompt"]).input_ids))
    messages = row["messages"]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                       and isinstance(m.get("content"), str) for m in messages)):
        raise PromptsError(f"{where}: 'messages' must be a list of {{role, content}} with text "
                           "content.")
    if not getattr(tokenizer, "chat_template", None):
        raise PromptsError(f"{where}: 'messages' needs a chat template, and the tokenizer has "
                           "none: give 'prompt' text instead.")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return Prompt(number, text, list(ids))


def output_row(prompt: Prompt, completion_ids: Sequence[int], finish_reason: str,
               tokenizer: Any) -> dict[str, Any]:
    """One line of the output file."""
    return {"prompt": prompt.text,
            "completion": tokenizer.decode(list(completion_ids), skip_special_tokens=True),
            "completion_ids": list(completion_ids), "finish_reason": finish_reason}
