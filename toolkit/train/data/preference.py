"""``data.mode: dpo``: preference pairs in TRL's formats, rendered exactly as TRL's
``DPOTrainer`` renders them, stored as one sample per pair: tokens [N, 2, seq_len+1] (chosen,
rejected) and a loss mask [N, 2, seq_len] on the completion's labels.

A row is ``{prompt, chosen, rejected}`` with strings ("standard") or message lists
("conversational"); without ``prompt`` (``data.prompt_field``) the prompt is what chosen and
rejected have in common at the start (whole turns; for strings whole characters, a trailing
space left to the completions). Strings: EOS (as text) is appended to each completion unless it
ends with it, and ``prompt``, ``prompt + chosen`` and ``prompt + rejected`` are tokenised with the
tokenizer's own special tokens (BOS convention). Conversations: the prompt turns through the chat
template with the generation prompt, prompt + completion turns without it. Either way the
completion starts where the tokenised prompt stops being a prefix of both tokenised sequences
(a token merging across the boundary moves it left, as in TRL). A pair is truncated to
``seq_len + 1`` tokens per sequence (keep the start); a pair whose prompt fills that is dropped
and counted. Refused, naming the row: no chosen or rejected, chosen equal to rejected, a
conversation without a chat template (or with ``data.template=plain``), an empty prompt (its
first completion token would have no context to be scored from), a file that mixes string and
conversational rows (``check_columns``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from toolkit.train.data.progress import SplitProgress
from toolkit.train.data.settings import DataError, DataSettings
from toolkit.train.data.sources import RowsPart, row_location, source_name

FIELDS = ("chosen", "rejected")  # TRL's names


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def split_prompt(row: dict[str, Any], settings: DataSettings) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a row, the prompt given or implicit (TRL's
    ``extract_prompt``: the common start, a string's trailing space left to the completions)."""
    for key in FIELDS:
        if row.get(key) is None:
            keys = sorted(k for k, v in row.items() if v is not None)
            raise DataError(f"the preference row has no '{key}' (its keys: {keys}): a DPO row "
                            f"needs 'chosen' and 'rejected' (and optionally "
                            f"'{settings.prompt_field}').")
    chosen, rejected = row["chosen"], row["rejected"]
    conversational = isinstance(chosen, list)
    for key in FIELDS:
        value = row[key]
        if conversational != isinstance(value, list) or not isinstance(value, (str, list)):
            raise DataError(f"'chosen' and 'rejected' must both be strings or both be lists of "
                            f"turns; '{key}' is {type(value).__name__}: {value!r}.")
    prompt = row.get(settings.prompt_field)
    if prompt is None:
        n = common_prefix(chosen, rejected)
        if not conversational and n and chosen[n - 1] == " ":
            n -= 1
        return chosen[:n], chosen[n:], rejected[n:]
    if conversational != isinstance(prompt, list):
        want = "a list of turns" if conversational else "a string"
        raise DataError(f"'{settings.prompt_field}' must be {want} like 'chosen' and "
                        f"'rejected', got {type(prompt).__name__}: {prompt!r}.")
    return prompt, chosen, rejected


def render(prompt, completions, tokenizer, settings: DataSettings,
           with_prompt: bool = True) -> list[list[int]]:
    """Token ids of the prompt (``with_prompt``) and of prompt + each completion, as TRL's
    preference trainers tokenise them."""
    if isinstance(prompt, list) or (completions and isinstance(completions[0], list)):
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if settings.template == "plain" or not has_template:
            raise DataError("the preference row is a conversation but "
                            + ("data.template=plain" if has_template else
                               "the tokenizer has no chat template")
                            + ": use string rows, or a tokenizer with a chat template.")

        def ids(turns, gen=False):
            out = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True,
                                                add_generation_prompt=gen)
            return list(out["input_ids"])

        return [ids(prompt, True)] * with_prompt + [ids(prompt + c) for c in completions]
    eos = tokenizer.eos_token
    texts = [prompt] * with_prompt + [prompt + (c if c.endswith(eos) else c + eos)
                                      for c in completions]
    return [list(tokenizer(t)["input_ids"]) for t in texts]


def encode_preference_row(row: dict[str, Any], tokenizer, settings: DataSettings,
                          ) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one row, as TRL tokenises it."""
    prompt, chosen, rejected = split_prompt(row, settings)
    if chosen == rejected:
        raise DataError("'chosen' and 'rejected' are the same: a pair must differ (remove the "
                        "row or fix its completions).")
    p, pc, pr = render(prompt, (chosen, rejected), tokenizer, settings)
    n = min(common_prefix(p, pc), common_prefix(p, pr))
    if n == 0:
        raise DataError("the prompt is empty: DPO scores completion tokens from the prompt "
                        "before them; give the row a prompt.")
    if pc[n:] == pr[n:]:
        raise DataError("'chosen' and 'rejected' render to the same tokens: a pair must differ.")
    return p[:n], pc[n:], pr[n:]


def pack_pairs(pairs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]],
               seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """-> tokens [N, 2, L+1] int32 (padded), loss mask [N, 2, L] uint8 on completion labels;
    each sequence truncated to L+1 tokens, pairs whose prompt fills them dropped (counted)."""
    width = seq_len + 1
    kept = [(p, c, r) for p, c, r in pairs if len(p) < width]
    stats = {"pairs": len(pairs), "dropped": len(pairs) - len(kept),
             "truncated": sum(len(p) + max(len(c), len(r)) > width for p, c, r in kept)}
    tokens = np.full((len(kept), 2, width), pad_id, dtype=np.int32)
    mask = np.zeros((len(kept), 2, width), dtype=np.uint8)
    for i, (p, *completions) in enumerate(kept):
        for j, c in enumerate(completions):
            ids = (list(p) + list(c))[:width]
            tokens[i, j, :len(ids)] = ids
            mask[i, j, len(p):len(ids)] = 1
    return tokens, mask[:, :, 1:].copy(), stats


def check_columns(part: RowsPart, keys: Sequence[str]) -> None:
    """HF datasets reads a JSON column that holds strings in some rows and lists in others as
    JSON text and decodes every value again, so a string like " 3." comes back as a number:
    refused, naming the file."""
    for key in keys:
        feature = part.rows.features.get(key)
        if type(feature).__name__ == "Json":
            raise DataError(f"{source_name(part.source)}: '{key}' holds strings in some rows and "
                            "lists of turns in others; put string rows and conversational rows "
                            "in separate files (HF datasets would read the strings as JSON text: "
                            "' 3.' becomes the number 3.0).")


def encode_parts(parts: Sequence[RowsPart], encode: Callable[[dict[str, Any]], dict[str, Any]],
                 keys: Sequence[str], progress: SplitProgress, procs: int | None,
                 ) -> dict[str, list[Any]]:
    """``encode(row)`` of every row of ``parts`` in order, its outputs by name; a refused row
    is named by file and line. ``keys``: the columns that must not mix strings and turns."""
    out: dict[str, list[Any]] = {}
    for part in parts:
        check_columns(part, keys)
        source, index = part.source, part.index

        def enc(row, i, offset, source=source, index=index):
            try:
                return encode(row)
            except DataError as e:
                at = row_location(source, int(index[offset + i]) if index is not None
                                  else offset + i)
                raise DataError(f"{at}: {e}") from None

        for _, chunk in progress.map(part.rows, enc, with_indices=True, num_proc=procs):
            for name in chunk.column_names:
                out.setdefault(name, []).extend(chunk[name])
    return out


def tokenize(parts: Sequence[RowsPart], tokenizer, settings: DataSettings, procs: int | None,
             progress: SplitProgress):
    """-> (tokens [N, 2, L+1] int32, loss_mask [N, 2, L] uint8, stats); sources in order."""
    def enc(row):
        p, c, r = encode_preference_row(row, tokenizer, settings)
        return {"prompt": p, "chosen": c, "rejected": r}

    out = encode_parts(parts, enc, (settings.prompt_field, *FIELDS), progress, procs)
    pairs = list(zip(out.get("prompt", []), out.get("chosen", []), out.get("rejected", []),
                     strict=True))
    return pack_pairs(pairs, settings.seq_len, tokenizer.pad_token_id)
