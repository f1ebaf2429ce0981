"""The SFT row formats: OpenAI-style messages, prompt/response, Alpaca and ShareGPT, detected per
row from its keys (or forced by ``data.format``), read into one ``SftExample``, and encoded
through the chat template or as plain prompt + response. A new format is a reader here and
its keys in ``format_keys``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolkit.train.data.encoding import encode_chat, encode_plain
from toolkit.train.data.settings import DataError, DataSettings

# Stanford Alpaca's prompts (github.com/tatsu-lab/stanford_alpaca, train.py), with the response
# on the line after "### Response:" as alpaca-lora and LLaMA-Factory's alpaca template write it.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
# ShareGPT ``from`` values (matched case-insensitively) -> chat roles. Only unambiguous names:
# "observation" is LLaMA-Factory's tool result; "function_call" (an assistant's call rendered by
# model-specific tool templates) is not guessed.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system", "tool": "tool",
                  "observation": "tool"}


@dataclass(frozen=True)
class SftExample:
    """One SFT row in the forms it can be rendered in: ``messages`` ({role, content} turns) for
    the chat template, ``plain`` (prompt, response) without one; None for conversations, which
    need the template (where the turns are and what they are called is the template's job)."""

    format: str
    messages: list[dict[str, Any]]
    plain: tuple[str, str] | None


def format_keys(settings: DataSettings) -> dict[str, tuple[str, ...]]:
    """The keys that identify each SFT format (the ones it cannot do without)."""
    return {"messages": (settings.messages_field,),
            "prompt_response": (settings.prompt_field, settings.response_field),
            "alpaca": ("instruction", "output"),
            "sharegpt": (settings.conversations_field,)}


def known_formats(settings: DataSettings) -> str:
    s = settings
    return (f"messages ('{s.messages_field}': [{{role, content}}, ...]), prompt_response "
            f"('{s.prompt_field}' + '{s.response_field}'), alpaca ('instruction' + 'output', "
            f"optional 'input'), sharegpt ('{s.conversations_field}': [{{from, value}}, ...])")


def detect_format(row: dict[str, Any], settings: DataSettings) -> str:
    """The row's format: ``data.format`` when set (the row must have its keys), else the one
    format whose keys the row has (missing and null values do not count)."""
    present = sorted(k for k, v in row.items() if v is not None)
    keys = format_keys(settings)
    if settings.sft_format != "auto":
        missing = [k for k in keys[settings.sft_format] if row.get(k) is None]
        if missing:
            raise DataError(f"data.format={settings.sft_format} but the row has no {missing} (its "
                            f"keys: {present}); set data.format=auto to detect each row's "
                            f"format, or fix the row. Known formats: {known_formats(settings)}.")
        return settings.sft_format
    found = [f for f, need in keys.items() if all(row.get(k) is not None for k in need)]
    if len(found) > 1:
        raise DataError(f"the sft row has keys {present}, which fit several formats "
                        f"({', '.join(found)}): set data.format to the one to read.")
    if not found:
        hint = (" (plain text is data.mode=pretrain)" if present == [settings.text_field] else "")
        raise DataError(f"the sft row has keys {present}{hint}, which fit no known format. Known "
                        f"formats: {known_formats(settings)}. Rename the columns, or set "
                        "data.prompt_field/response_field/messages_field/conversations_field "
                        "to yours.")
    return found[0]


def _text(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise DataError(f"'{key}' must be a string, got {type(value).__name__}: {value!r}.")
    return value


def _turn_list(row: dict[str, Any], field: str) -> list[dict[str, Any]]:
    turns = row[field]
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise DataError(f"'{field}' must be a list of turn objects, got {turns!r}.")
    return turns


def _chat_turns(row: dict[str, Any], field: str) -> list[dict[str, Any]]:
    """OpenAI-style turns, as given (templates may read keys beyond role and content)."""
    turns = _turn_list(row, field)
    for i, t in enumerate(turns):
        if t.get("role") is None:
            keys = sorted(k for k, v in t.items() if v is not None)
            hint = (f"these are ShareGPT turns: set data.format=sharegpt and "
                    f"data.conversations_field={field}" if t.get("from") is not None
                    else "each turn needs a 'role' and a 'content'")
            raise DataError(f"turn {i} of '{field}' has no 'role' (its keys: {keys}): {hint}.")
        content = t.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise DataError(f"turn {i} of '{field}': 'content' must be text (or a list of "
                            f"content parts), got {type(content).__name__}: {content!r}.")
    return list(turns)


def _sharegpt_turns(row: dict[str, Any], field: str) -> list[dict[str, Any]]:
    """ShareGPT turns -> {role, content} turns (roles by ``SHAREGPT_ROLES``)."""
    out = []
    for i, t in enumerate(_turn_list(row, field)):
        who, text = t.get("from"), t.get("value")
        if who is None or not isinstance(text, str):
            keys = sorted(k for k, v in t.items() if v is not None)
            hint = (f"these are OpenAI-style turns: set data.format=messages and "
                    f"data.messages_field={field}" if t.get("role") is not None
                    else "each ShareGPT turn needs a 'from' and a string 'value'")
            raise DataError(f"turn {i} of '{field}' has keys {keys}: {hint}.")
        role = SHAREGPT_ROLES.get(str(who).lower())
        if role is None:
            known = ", ".join(f"{k}->{v}" for k, v in SHAREGPT_ROLES.items())
            raise DataError(f"turn {i} of '{field}' is from {who!r}, not a ShareGPT role this "
                            f"reader knows ({known}): rename it in the data.")
        out.append({"role": role, "content": text})
    return out


def _messages(row: dict[str, Any], settings: DataSettings) -> SftExample:
    return SftExample("messages", _chat_turns(row, settings.messages_field), None)


def _sharegpt(row: dict[str, Any], settings: DataSettings) -> SftExample:
    return SftExample("sharegpt", _sharegpt_turns(row, settings.conversations_field), None)


def _prompt_response(row: dict[str, Any], settings: DataSettings) -> SftExample:
    prompt, answer = _text(row, settings.prompt_field), _text(row, settings.response_field)
    return _exchange("prompt_response", prompt, prompt, answer)


def _alpaca(row: dict[str, Any], settings: DataSettings) -> SftExample:
    """Through a chat template the user turn is the instruction, then a blank line and the input
    when there is one (the Alpaca preamble is a prompt format for base models; a chat model has
    its own); without a template the prompt is the Stanford Alpaca template (its no-input
    variant for an empty input)."""
    instruction, answer = _text(row, "instruction"), _text(row, "output")
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise DataError(f"'input' must be a string, got {type(extra).__name__}: {extra!r}.")
    if extra.strip():
        return _exchange("alpaca", f"{instruction}\n\n{extra}",
                         ALPACA_PROMPT.format(instruction=instruction, input=extra), answer)
    return _exchange("alpaca", instruction, ALPACA_PROMPT_NO_INPUT.format(instruction=instruction),
                     answer)


def _exchange(fmt: str, user: str, plain: str, answer: str) -> SftExample:
    """One user turn and its answer: as chat turns, and as a plain (prompt, response)."""
    return SftExample(fmt, [{"role": "user", "content": user},
                            {"role": "assistant", "content": answer}], (plain, answer))


#: The reader of each format, in the order ``format_keys`` lists their keys.
READERS = {"messages": _messages, "prompt_response": _prompt_response, "alpaca": _alpaca,
           "sharegpt": _sharegpt}
SFT_FORMATS = tuple(READERS)


def sft_example(row: dict[str, Any], settings: DataSettings) -> SftExample:
    """Read one SFT row in its format (``detect_format``; the readers above)."""
    return READERS[detect_format(row, settings)](row, settings)


def encode_sft_row(row: dict[str, Any], tokenizer, settings: DataSettings,
                   ) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one SFT row: its conversation through the chat template when
    one is used (``data.template``), else ``encode_plain`` of its (prompt, response)."""
    example = sft_example(row, settings)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if settings.template == "chat" and not has_template:
        raise DataError("data.template=chat but the tokenizer has no chat template.")
    if has_template and settings.template != "plain":
        return encode_chat(example.messages, tokenizer)
    if example.plain is None:
        raise DataError(f"the row is a conversation ({example.format}) but "
                        + ("data.template=plain" if has_template else
                           "the tokenizer has no chat template")
                        + ": use prompt/response or alpaca rows, or a tokenizer with a chat "
                          "template.")
    return encode_plain(*example.plain, tokenizer)
