"""Tokenising: the HF tokenizer of a run, a conversation through its chat template (mask on the
assistant turns), and a plain prompt + response."""

from __future__ import annotations

from typing import Any

from toolkit.train.data.settings import DataError


def load_tokenizer(path: str):
    """An HF tokenizer from a local folder (or a hub id); pad defaults to EOS."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise DataError(f"tokenizer {path!r} could not be loaded: {e}") from e
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer {path!r} has no EOS token: documents cannot be separated.")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def encode_chat(messages: list[dict[str, Any]], tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask that is 1 on assistant turns.

    An assistant turn's text is what the template adds between ``messages[:i]`` rendered with the
    generation prompt and ``messages[:i+1]``; a token belongs to it when its first character does.
    Templates whose renderings are not prefixes of each other are refused (the mask would lie).
    """
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prefix = _prompt(tokenizer, messages[:i]) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise DataError("the tokenizer's chat template renders a conversation differently "
                            "from its prefixes, so assistant tokens cannot be located; use "
                            "data.template=plain with prompt/response rows or another template.")
        if len(upto) == len(prefix):
            raise DataError(f"the tokenizer's chat template renders assistant turn {i} as "
                            "nothing, so there is no answer to train on: use a chat template that "
                            "renders assistant turns, or data.template=plain.")
        spans.append((len(prefix), len(upto)))
    if not spans:
        raise DataError(f"conversation has no assistant turn: {messages!r}")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _prompt(tokenizer, messages: list[dict[str, Any]]) -> str:
    """``messages`` rendered with the generation prompt, which must differ from without it:
    a template without one (no generation marker) gives no way to tell an assistant turn's role
    header from its answer, and the header would silently be trained on as answer."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if prompt == tokenizer.apply_chat_template(messages, tokenize=False):
        raise DataError("the tokenizer's chat template has no generation prompt "
                        "(add_generation_prompt changes nothing), so the assistant turns' own "
                        "tokens cannot be told from their role header: give the template a "
                        "generation prompt ({% if add_generation_prompt %}...{% endif %}, the "
                        "assistant header), or use data.template=plain with prompt/response or "
                        "alpaca rows.")
    return prompt


def encode_plain(prompt: str, response: str, tokenizer) -> tuple[list[int], list[int]]:
    """``tokens(prompt)`` (with the tokenizer's BOS convention) + ``tokens(response)`` + EOS;
    the mask is 1 on response + EOS. Prompt and response are tokenised separately so the
    boundary is exact: put any separator (space, newline) in the text itself."""
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return list(p) + list(r), [0] * len(p) + [1] * len(r)
