"""Training data: HF ``datasets`` sources -> tokenised fixed-length samples cached on disk ->
the micro-batches each data-parallel rank reads at a given optimizer step.

Every sample is ``seq_len + 1`` token ids (inputs are ``[:-1]``, labels ``[1:]``) plus a loss mask
over the ``seq_len`` labels, stored as two ``.npy`` arrays that every rank memory-maps. Two modes:

- ``pretrain``: each document is tokenised (the tokenizer's own BOS convention), EOS appended,
  all documents concatenated and cut into blocks of ``seq_len + 1`` that overlap by one token
  (every token is a label once); the tail shorter than a block is dropped. Loss mask all ones.
- ``sft``: each row is read in one of four formats, detected per row from its keys (so each
  source, and each row of a mixed file, may have its own) or forced by ``data.format``:
  OpenAI-style ``{messages: [{role, content}, ...]}``, ``{prompt, response}``, Alpaca
  ``{instruction, input?, output}`` and ShareGPT ``{conversations: [{from, value}, ...]}``
  (see ``SftExample``). With the tokenizer's chat template (``data.template`` chat, or auto and
  the tokenizer has one) every row is rendered as a conversation and the loss mask is 1 exactly
  on the tokens of assistant turns (what the template renders after the generation prompt,
  including its end-of-turn marker). Without it, prompt/response and Alpaca rows are
  ``tokens(prompt) + tokens(response) + [EOS]`` with the mask on response + EOS (Alpaca's prompt
  is the Stanford Alpaca template); conversations then need a template and are refused. Rows
  longer than ``seq_len + 1`` are truncated (rows left with no response token are dropped);
  shorter ones are right-padded (mask 0), or, with ``pack``, several rows share one sequence
  (attention is causal across the packed rows; no per-row attention reset). A row that cannot be
  read is reported with its file and line.

Data order (``GlobalBatchSampler``): the optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)``
of an endless stream made of one seeded permutation of the training set per epoch. The global
batch of a step depends only on (seed, G, step, data), never on dp: resuming at any step with any
dp (and any micro_batch) that divides the same global batch G sees exactly the same samples in
each global batch. Changing G, the seed or the data is not a resume (the checkpoint manager
refuses it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import itertools
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.errors import UserError

FORMAT_VERSION = 1
SFT_FORMATS = ("messages", "prompt_response", "alpaca", "sharegpt")
# Settings added after FORMAT_VERSION 1 enter the cache key only when changed from these
# defaults: the data they did not exist for tokenises the same, so its caches and the data
# fingerprints recorded in checkpoints stay valid.
_LATER_SETTINGS = {"sft_format": "auto", "conversations_field": "conversations"}
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
             ".text": "text"}


class DataError(UserError):
    """Data that cannot be used; the message names the source, the row or the setting."""


# -- settings ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSettings:
    """Everything that changes the tokenised samples (and so the cache key)."""

    mode: str
    sources: tuple[str, ...]
    seq_len: int
    seed: int = 1234
    validation_sources: tuple[str, ...] = ()
    validation_split: float = 0.0
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    template: str = "auto"
    pack: bool = False
    sft_format: str = "auto"  # data.format: auto (per row) or one of SFT_FORMATS
    conversations_field: str = "conversations"

    @classmethod
    def from_config(cls, cfg) -> DataSettings:
        """From a ``config.TrainConfig``."""
        d = cfg.data
        return cls(mode=d.mode, sources=tuple(d.sources), seq_len=cfg.train.seq_len,
                   seed=cfg.train.seed, validation_sources=tuple(d.validation_sources),
                   validation_split=d.validation_split, text_field=d.text_field,
                   prompt_field=d.prompt_field, response_field=d.response_field,
                   messages_field=d.messages_field, template=d.template, pack=d.pack,
                   sft_format=d.format, conversations_field=d.conversations_field)


# -- sources -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One ``datasets`` load: a builder over local files, or a hub dataset name."""

    builder: str  # json / parquet / text / hub
    files: tuple[str, ...] = ()
    name: str = ""


def resolve_sources(specs: Sequence[str]) -> list[Source]:
    """Expand files, folders and globs; anything else that is not a local path is a hub name."""
    out: list[Source] = []
    for spec in specs:
        if any(ch in spec for ch in "*?["):
            files = sorted(glob.glob(spec, recursive=True))
            if not files:
                raise DataError(f"data source {spec!r}: the glob matches no file.")
        elif Path(spec).is_dir():
            files = sorted(str(p) for p in Path(spec).rglob("*") if p.suffix in _BUILDERS)
            if not files:
                raise DataError(f"data source {spec!r}: folder holds no "
                                f"{'/'.join(sorted(_BUILDERS))} file.")
        elif Path(spec).is_file():
            files = [spec]
        elif Path(spec).suffix in _BUILDERS or spec.startswith((".", "/", "~")):
            raise DataError(f"data source {spec!r}: no such file.")
        else:
            out.append(Source("hub", name=spec))
            continue
        for f in files:
            suffix = Path(f).suffix
            if suffix not in _BUILDERS:
                raise DataError(f"data file {f!r}: unknown type {suffix!r}; use one of "
                                f"{', '.join(sorted(_BUILDERS))}.")
            builder = _BUILDERS[suffix]
            if out and out[-1].builder == builder:
                out[-1] = Source(builder, out[-1].files + (f,))
            else:
                out.append(Source(builder, (f,)))
    return out


@dataclass(frozen=True)
class RowsPart:
    """The rows of one source as a ``datasets.Dataset``. After a split, ``index`` holds each
    row's number in the source (for errors that name the file and line); None: in order."""

    source: Source
    rows: Any
    index: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows)


def _load_source(src: Source) -> list[RowsPart]:
    """The rows of a local source. Its files are loaded together (fast for many shards); files
    whose columns differ (say one file per SFT format) cannot be, so on failure they are loaded
    one by one, which also names the file that cannot be read (and, for JSON, its line)."""
    import datasets

    kwargs = {"sample_by": "paragraph"} if src.builder == "text" else {}
    try:
        return [RowsPart(src, datasets.load_dataset(src.builder, data_files=list(src.files),
                                                    split="train", **kwargs))]
    except Exception as e:  # datasets wraps the reader's error in DatasetGenerationError
        if len(src.files) > 1:
            return [p for f in src.files for p in _load_source(Source(src.builder, (f,)))]
        path = src.files[0]
        cause = e.__cause__ or e
        raise DataError((_bad_json(path) if src.builder == "json" else None)
                        or f"data file {path} could not be read as {src.builder}: "
                           f"{type(cause).__name__}: {cause}") from e


def _first_char(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return line.lstrip()[0]
    return ""


def _bad_json(path: str) -> str | None:
    """Where a JSON / JSON Lines file is malformed (``file:line: ...``), or None if it parses."""
    if _first_char(path) == "[":  # one JSON array
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            at = f"{path}:{e.lineno}" if isinstance(e, json.JSONDecodeError) else path
            return f"{at}: not valid JSON ({e}): fix the file."
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return (f"{path}:{n}: not valid JSON ({e.msg}, column {e.pos + 1}): each line of a "
                        "JSON Lines file must be one complete JSON object; fix or remove the line.")
            if not isinstance(row, dict):
                return (f"{path}:{n}: a JSON Lines row must be an object {{...}}, got "
                        f"{type(row).__name__}.")
    return None


def load_parts(specs: Sequence[str]) -> list[RowsPart]:
    """The rows of each source, in the order given (sources may have different columns)."""
    import datasets

    parts = []
    for src in resolve_sources(specs):
        if src.builder != "hub":
            parts += _load_source(src)
            continue
        try:
            parts.append(RowsPart(src, datasets.load_dataset(src.name, split="train")))
        except Exception as e:  # datasets raises many types for a missing/unreachable name
            raise DataError(f"data source {src.name!r} is neither a local file nor a "
                            f"loadable hub dataset: {e}") from e
    return parts


def split_parts(parts: Sequence[RowsPart], fraction: float, seed: int,
                ) -> tuple[list[RowsPart], list[RowsPart]]:
    """``split_indices`` over all rows of all sources (as if concatenated), per source."""
    train, val = split_indices(sum(len(p) for p in parts), fraction, seed)
    out: tuple[list[RowsPart], list[RowsPart]] = ([], [])
    start = 0
    for part in parts:
        for dest, idx in zip(out, (train, val), strict=True):
            mine = idx[(idx >= start) & (idx < start + len(part))] - start
            if len(mine):
                dest.append(RowsPart(part.source, part.rows.select(mine), mine))
        start += len(part)
    return out


def row_location(source: Source, row: int) -> str:
    """``file:line`` of 0-based row ``row`` of a source (JSON Lines), else ``file row N``.
    Reads the files again: for error messages only."""
    if source.builder == "hub":
        return f"hub dataset {source.name!r} row {row + 1}"
    path, local = source.files[0], row
    if len(source.files) > 1:  # the rows are the files' rows in order
        for path in source.files:
            n = len(_load_source(Source(source.builder, (path,)))[0])
            if local < n:
                break
            local -= n
    if source.builder == "json" and _first_char(path) != "[":
        with open(path, encoding="utf-8", errors="replace") as f:
            nonblank = (n for n, line in enumerate(f, 1) if line.strip())
            line = next(itertools.islice(nonblank, local, None), None)
        if line is not None:
            return f"{path}:{line}"
    return f"{path} row {local + 1}"


def _source_name(source: Source) -> str:
    if source.builder == "hub":
        return f"hub dataset {source.name!r}"
    more = f" (+{len(source.files) - 1} more files)" if len(source.files) > 1 else ""
    return f"{source.files[0]}{more}"


def _sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sources_fingerprint(specs: Sequence[str]) -> list[str]:
    """Content hashes of local files (renaming or moving them keeps the cache), names for hub."""
    return [f"hub:{s.name}" if s.builder == "hub" else _sha256_file(f)
            for s in resolve_sources(specs) for f in (s.files or ("",))]


def tokenizer_fingerprint(path: str) -> str:
    p = Path(path)
    if not p.is_dir():
        return f"hub:{path}"
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + _sha256_file(f).encode())
    return h.hexdigest()


def cache_key(settings: DataSettings, tokenizer_path: str) -> str:
    d = {k: v for k, v in dataclasses.asdict(settings).items()
         if k not in _LATER_SETTINGS or v != _LATER_SETTINGS[k]}
    d["sources"] = sources_fingerprint(settings.sources)
    d["validation_sources"] = sources_fingerprint(settings.validation_sources)
    d["tokenizer"] = tokenizer_fingerprint(tokenizer_path)
    d["format"] = FORMAT_VERSION
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:20]


# -- tokenisation ------------------------------------------------------------------------------
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
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                               add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise DataError("the tokenizer's chat template renders a conversation differently "
                            "from its prefixes, so assistant tokens cannot be located; use "
                            "data.template=plain with prompt/response rows or another template.")
        spans.append((len(prefix), len(upto)))
    if not spans:
        raise DataError(f"conversation has no assistant turn: {messages!r}")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def encode_plain(prompt: str, response: str, tokenizer) -> tuple[list[int], list[int]]:
    """``tokens(prompt)`` (with the tokenizer's BOS convention) + ``tokens(response)`` + EOS;
    the mask is 1 on response + EOS. Prompt and response are tokenised separately so the
    boundary is exact: put any separator (space, newline) in the text itself."""
    p = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return list(p) + list(r), [0] * len(p) + [1] * len(r)


# -- SFT row formats ---------------------------------------------------------------------------
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


def sft_example(row: dict[str, Any], settings: DataSettings) -> SftExample:
    """Read one SFT row (format by ``detect_format``). Alpaca: through a chat template the user
    turn is the instruction, then a blank line and the input when there is one (the Alpaca
    preamble is a prompt format for base models; a chat model has its own); without a template
    the prompt is the Stanford Alpaca template (its no-input variant for an empty input)."""
    fmt = detect_format(row, settings)
    if fmt == "messages":
        return SftExample(fmt, _chat_turns(row, settings.messages_field), None)
    if fmt == "sharegpt":
        return SftExample(fmt, _sharegpt_turns(row, settings.conversations_field), None)
    if fmt == "prompt_response":
        prompt, answer = _text(row, settings.prompt_field), _text(row, settings.response_field)
        user, plain = prompt, prompt
    else:  # alpaca
        instruction, answer = _text(row, "instruction"), _text(row, "output")
        extra = row.get("input") or ""
        if not isinstance(extra, str):
            raise DataError(f"'input' must be a string, got {type(extra).__name__}: {extra!r}.")
        if extra.strip():
            user = f"{instruction}\n\n{extra}"
            plain = ALPACA_PROMPT.format(instruction=instruction, input=extra)
        else:
            user, plain = instruction, ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
    return SftExample(fmt, [{"role": "user", "content": user},
                            {"role": "assistant", "content": answer}], (plain, answer))


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


def pack_pretrain(docs: Sequence[Sequence[int]], seq_len: int) -> np.ndarray:
    """Concatenate token lists and cut blocks of seq_len+1 overlapping by one token."""
    stream = np.fromiter((t for d in docs for t in d), dtype=np.int64)
    n = (len(stream) - 1) // seq_len if len(stream) > seq_len else 0
    if n == 0:
        return np.zeros((0, seq_len + 1), dtype=np.int32)
    starts = np.arange(n) * seq_len
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)


def pack_sft(examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int,
             pack: bool) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Rows of seq_len+1 tokens and the (seq_len) label mask; truncate, drop, pad or pack."""
    width = seq_len + 1
    rows: list[tuple[list[int], list[int]]] = []
    stats = {"examples": len(examples), "truncated": 0, "dropped": 0}
    cur_ids: list[int] = []
    cur_mask: list[int] = []
    for ids, mask in examples:
        if len(ids) > width:
            stats["truncated"] += 1
            ids, mask = ids[:width], mask[:width]
        if not any(mask[1:]):  # the first token is never a label
            stats["dropped"] += 1
            continue
        if pack and len(cur_ids) + len(ids) <= width:
            cur_ids, cur_mask = cur_ids + list(ids), cur_mask + list(mask)
            continue
        if cur_ids:
            rows.append((cur_ids, cur_mask))
        cur_ids, cur_mask = list(ids), list(mask)
    if cur_ids:
        rows.append((cur_ids, cur_mask))
    tokens = np.full((len(rows), width), pad_id, dtype=np.int32)
    tmask = np.zeros((len(rows), width), dtype=np.uint8)
    for i, (ids, mask) in enumerate(rows):
        tokens[i, : len(ids)] = ids
        tmask[i, : len(mask)] = mask
    return tokens, tmask[:, 1:].copy(), stats


@contextlib.contextmanager
def _datasets_quiet() -> Iterator[None]:
    """``datasets``' untitled progress bars off (its warnings stay on)."""
    import datasets

    was_off = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


_CHUNK_ROWS = 1000  # rows per datasets.map call: the bar moves at least every this many rows


class _SplitProgress:
    """One titled bar per split (``tokenising train``) over the rows of all its sources
    (``datasets``' own bars, one per file load and per map, are off: ``_datasets_quiet``)."""

    def __init__(self, name: str, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.bar = Progress(TextColumn(f"tokenising {name}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("rows"), transient=False)
        self.task = self.bar.add_task(name, total=total)

    def __enter__(self) -> _SplitProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def map(self, rows, fn, **kwargs) -> Iterator[tuple[int, Any]]:
        """``rows.map(fn, **kwargs)`` in chunks, advancing the bar: yields (first row, result);
        ``fn`` gets the chunk's first row as ``offset`` when ``with_indices``."""
        n = len(rows)
        step = max(_CHUNK_ROWS, -(-n // 20))
        for a in range(0, n, step):
            chunk = rows if step >= n else rows.select(range(a, min(a + step, n)))
            extra = {"fn_kwargs": {"offset": a}} if kwargs.get("with_indices") else {}
            yield a, chunk.map(fn, remove_columns=chunk.column_names, **extra, **kwargs)
            self.bar.advance(self.task, len(chunk))


def _tokenize_split(parts: Sequence[RowsPart], tokenizer, settings: DataSettings, num_proc: int,
                    name: str):
    """-> (tokens [N, L+1] int32, loss_mask [N, L] uint8, stats); sources in order."""
    L = settings.seq_len
    procs = num_proc if num_proc > 1 else None
    with _SplitProgress(name, sum(len(p) for p in parts)) as progress:
        if settings.mode == "pretrain":
            return _tokenize_pretrain(parts, tokenizer, settings, procs, progress)
        examples: list[tuple[list[int], list[int]]] = []
        for part in parts:
            source, index = part.source, part.index

            def enc(row, i, offset, source=source, index=index):
                try:
                    ids, mask = encode_sft_row(row, tokenizer, settings)
                except DataError as e:
                    at = row_location(source, int(index[offset + i]) if index is not None
                                      else offset + i)
                    raise DataError(f"{at}: {e}") from None
                return {"ids": ids, "mask": mask}

            for _, out in progress.map(part.rows, enc, with_indices=True, num_proc=procs):
                examples += zip(out["ids"], out["mask"], strict=True)
    return pack_sft(examples, L, tokenizer.pad_token_id, settings.pack)


def _tokenize_pretrain(parts: Sequence[RowsPart], tokenizer, settings: DataSettings,
                       procs: int | None, progress: _SplitProgress):
    L, eos = settings.seq_len, tokenizer.eos_token_id

    def tok(batch):
        ids = tokenizer(batch[settings.text_field], add_special_tokens=True)["input_ids"]
        return {"ids": [list(x) + [eos] if not x or x[-1] != eos else list(x) for x in ids]}

    docs: list[list[int]] = []
    for part in parts:
        if settings.text_field not in part.rows.column_names:
            raise DataError(f"pretrain data {_source_name(part.source)} has no "
                            f"'{settings.text_field}' column (columns: "
                            f"{part.rows.column_names}); set data.text_field.")
        for _, out in progress.map(part.rows, tok, batched=True, num_proc=procs):
            docs += out["ids"]
    tokens = pack_pretrain(docs, L)
    stats = {"documents": len(docs), "tokens": int(sum(len(d) for d in docs))}
    return tokens, np.ones((len(tokens), L), dtype=np.uint8), stats


def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded document-level split (before packing, so no document straddles both sets).
    Returns sorted (train, validation) row indices; at least one validation row when
    fraction > 0 and n >= 2."""
    n_val = int(round(n * fraction))
    if fraction > 0 and n >= 2:
        n_val = min(max(1, n_val), n - 1)
    perm = np.random.default_rng([seed, 0x5EED]).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


# -- cached result -----------------------------------------------------------------------------
@dataclass
class TokenizedSplit:
    """Fixed-length samples: ``tokens`` [N, seq_len+1] int32, ``loss_mask`` [N, seq_len] uint8."""

    tokens: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, Any]:
        """Tensors for one micro-batch: tokens/labels/position_ids int64 [b, s], loss_mask
        float32 [b, s] (labels are valid ids everywhere; the mask says which count)."""
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        t = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        seq = t.shape[1] - 1
        return {
            "tokens": t[:, :-1].contiguous(),
            "labels": t[:, 1:].contiguous(),
            "loss_mask": torch.from_numpy(np.asarray(self.loss_mask[idx], dtype=np.float32)),
            "position_ids": torch.arange(seq, dtype=torch.int64).expand(len(idx), seq).clone(),
        }


@dataclass
class PreparedData:
    train: TokenizedSplit
    validation: TokenizedSplit | None
    key: str  # cache key: also the data fingerprint a checkpoint records
    path: Path
    meta: dict[str, Any]


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _load(path: Path) -> PreparedData:
    meta = json.loads((path / "meta.json").read_text())

    def split(name: str) -> TokenizedSplit | None:
        if not (path / f"{name}_tokens.npy").exists():
            return None
        return TokenizedSplit(np.load(path / f"{name}_tokens.npy", mmap_mode="r"),
                              np.load(path / f"{name}_loss_mask.npy", mmap_mode="r"))

    train = split("train")
    assert train is not None, f"{path} lacks train arrays"  # meta.json is written after them
    return PreparedData(train, split("validation"), meta["key"], path, meta)


def _build(settings: DataSettings, tokenizer_path: str, key: str, num_proc: int,
           ) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Load, split and tokenise: (meta.json contents, arrays per split)."""
    tokenizer = load_tokenizer(tokenizer_path)
    parts = load_parts(settings.sources)
    val_parts: list[RowsPart] | None = None
    if settings.validation_sources:
        val_parts = load_parts(settings.validation_sources)
    elif settings.validation_split > 0:
        parts, val_parts = split_parts(parts, settings.validation_split, settings.seed)

    meta: dict[str, Any] = {"key": key, "format": FORMAT_VERSION,
                            "settings": dataclasses.asdict(settings),
                            "tokenizer": tokenizer_path, "vocab_size": len(tokenizer),
                            "eos_id": tokenizer.eos_token_id, "pad_id": tokenizer.pad_token_id}
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, split in (("train", parts), ("validation", val_parts)):
        if split is None:
            continue
        tokens, mask, stats = _tokenize_split(split, tokenizer, settings, num_proc, name)
        if name == "train" and len(tokens) == 0:
            raise DataError(f"no training sample of seq_len+1={settings.seq_len + 1} tokens could "
                            f"be built from {list(settings.sources)} ({stats}): add data or "
                            "lower train.seq_len.")
        arrays[name] = (tokens, mask)
        meta[name] = {"samples": len(tokens), **stats,
                      "max_token_id": int(tokens.max()) if len(tokens) else -1,
                      "loss_tokens": int(mask.sum())}
    return meta, arrays


def prepare_data(settings: DataSettings, tokenizer_path: str, cache_dir: str | Path,
                 num_proc: int = 1) -> PreparedData:
    """Tokenise (or reuse the cache keyed by source contents + tokenizer + settings).

    Single-process and idempotent; the cache folder is written to a temporary sibling and
    renamed, so a crashed or concurrent writer never leaves a half-written entry behind."""
    if settings.mode not in ("pretrain", "sft"):
        raise DataError(f"data.mode={settings.mode!r}: choose pretrain or sft.")
    key = cache_key(settings, tokenizer_path)
    cache = Path(cache_dir)
    final = cache / key
    if (final / "meta.json").is_file():
        return _load(final)

    with _datasets_quiet():
        meta, arrays = _build(settings, tokenizer_path, key, num_proc)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name, (tokens, mask) in arrays.items():
            _save_npy(tmp / f"{name}_tokens.npy", tokens)
            _save_npy(tmp / f"{name}_loss_mask.npy", mask)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another writer finished first: its entry is identical
            if not (final / "meta.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _load(final)


def prepare_data_distributed(settings: DataSettings, tokenizer_path: str, cache_dir: str | Path,
                             num_proc: int = 1) -> PreparedData:
    """Collective: local rank 0 of each node tokenises (or hits the cache), then every rank
    memory-maps the cache. A failure on a writer is raised on every rank (no hang): its
    ``DataError`` as it is, so the run reports it once."""
    import torch.distributed as dist

    from toolkit import runtime

    if not (dist.is_available() and dist.is_initialized()):
        return prepare_data(settings, tokenizer_path, cache_dir, num_proc)
    with runtime.failing_together():
        if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
            prepare_data(settings, tokenizer_path, cache_dir, num_proc)
    return prepare_data(settings, tokenizer_path, cache_dir, num_proc)


# -- sampling ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


@dataclass(frozen=True)
class GlobalBatchSampler:
    """Which samples each data-parallel rank reads at each optimizer step (see module doc).

    Rank ``r`` reads the contiguous share ``[r*G/dp, (r+1)*G/dp)`` of the step's global batch,
    split into ``grad_accum`` micro-batches of ``micro_batch`` samples, in order.
    """

    num_samples: int
    global_batch: int
    micro_batch: int
    dp_size: int
    dp_rank: int
    seed: int
    shuffle: bool = True

    # Resuming with another dp (same global batch) reproduces every global batch.
    supports_dp_change = True

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise DataError("the training set is empty.")
        if not 0 <= self.dp_rank < self.dp_size:
            raise DataError(f"dp_rank={self.dp_rank} outside dp_size={self.dp_size}.")
        if self.global_batch % (self.micro_batch * self.dp_size):
            raise DataError(f"global_batch={self.global_batch} is not divisible by micro_batch * "
                            f"dp = {self.micro_batch} * {self.dp_size}.")

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def consumed_samples(self, steps: int) -> int:
        return steps * self.global_batch

    def epoch(self, step: int) -> float:
        """Epochs completed before ``step`` (fractional)."""
        return step * self.global_batch / self.num_samples

    def global_indices(self, step: int) -> np.ndarray:
        """Sample indices of the whole global batch of 0-based optimizer step ``step``."""
        stream = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        epochs, pos = np.divmod(stream, self.num_samples)
        out = np.empty_like(stream)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = _epoch_order(self.num_samples, self.seed, int(e), self.shuffle)[pos[sel]]
        return out

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's ``grad_accum`` micro-batches (index arrays) for step ``step``."""
        share = self.global_batch // self.dp_size
        mine = self.global_indices(step)[self.dp_rank * share:(self.dp_rank + 1) * share]
        return [mine[i:i + self.micro_batch] for i in range(0, share, self.micro_batch)]


def step_batches(split: TokenizedSplit, sampler: GlobalBatchSampler, step: int,
                 ) -> Iterator[dict[str, Any]]:
    """This rank's micro-batches of optimizer step ``step`` as tensor dicts (the
    ``data_iterator`` of one training step)."""
    for indices in sampler.micro_batches(step):
        yield split.batch(indices)


def eval_micro_batches(num_samples: int, micro_batch: int, dp_size: int, dp_rank: int,
                       max_batches: int | None = None) -> list[np.ndarray]:
    """Validation in order, ``micro_batch * dp`` samples per round, rank ``r`` taking the r-th
    micro-batch of each round; the incomplete last round is dropped so every rank runs the same
    number of micro-batches. ``max_batches`` caps the rounds."""
    per_round = micro_batch * dp_size
    rounds = num_samples // per_round
    if rounds == 0:
        raise DataError(f"the validation set has {num_samples} samples, fewer than micro_batch * "
                        f"dp = {per_round}: add validation data or raise data.validation_split.")
    if max_batches is not None:
        rounds = min(rounds, max_batches)
    start = dp_rank * micro_batch
    return [np.arange(r * per_round + start, r * per_round + start + micro_batch)
            for r in range(rounds)]
