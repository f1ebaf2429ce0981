"""Training data: HF ``datasets`` sources -> tokenised fixed-length samples cached on disk ->
the micro-batches each data-parallel rank reads at a given optimizer step.

Every sample is ``seq_len + 1`` token ids (inputs are ``[:-1]``, labels ``[1:]``) plus a loss mask
over the ``seq_len`` labels, stored as two ``.npy`` arrays that every rank memory-maps. Two modes:

- ``pretrain``: each document is tokenised (the tokenizer's own BOS convention), EOS appended,
  all documents concatenated and cut into blocks of ``seq_len + 1`` that overlap by one token
  (every token is a label once); the tail shorter than a block is dropped. Loss mask all ones.
- ``sft``: a row is ``{prompt, response}`` or ``{messages: [{role, content}, ...]}``. Chat rows
  (and prompt/response rows when the chat template is used) are rendered with the tokenizer's
  chat template; the loss mask is 1 exactly on the tokens of assistant turns (what the template
  renders after the generation prompt, including its end-of-turn marker). ``plain`` rows are
  ``tokens(prompt) + tokens(response) + [EOS]`` with the mask on response + EOS. Rows longer than
  ``seq_len + 1`` are truncated (rows left with no response token are dropped); shorter ones are
  right-padded (mask 0), or, with ``pack``, several rows share one sequence (attention is causal
  across the packed rows; no per-row attention reset).

Data order (``GlobalBatchSampler``): the optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)``
of an endless stream made of one seeded permutation of the training set per epoch. The global
batch of a step depends only on (seed, G, step, data), never on dp: resuming at any step with any
dp (and any micro_batch) that divides the same global batch G sees exactly the same samples in
each global batch. Changing G, the seed or the data is not a resume (the checkpoint manager
refuses it).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
             ".text": "text"}


class DataError(ValueError):
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

    @classmethod
    def from_config(cls, cfg) -> DataSettings:
        """From a ``config.TrainConfig``."""
        d = cfg.data
        return cls(mode=d.mode, sources=tuple(d.sources), seq_len=cfg.train.seq_len,
                   seed=cfg.train.seed, validation_sources=tuple(d.validation_sources),
                   validation_split=d.validation_split, text_field=d.text_field,
                   prompt_field=d.prompt_field, response_field=d.response_field,
                   messages_field=d.messages_field, template=d.template, pack=d.pack)


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


def load_rows(specs: Sequence[str]):
    """All rows of the sources as one ``datasets.Dataset`` (in the order given)."""
    import datasets

    parts = []
    for src in resolve_sources(specs):
        if src.builder == "hub":
            try:
                parts.append(datasets.load_dataset(src.name, split="train"))
            except Exception as e:  # datasets raises many types for a missing/unreachable name
                raise DataError(f"data source {src.name!r} is neither a local file nor a "
                                f"loadable hub dataset: {e}") from e
        else:
            kwargs = {"sample_by": "paragraph"} if src.builder == "text" else {}
            parts.append(datasets.load_dataset(src.builder, data_files=list(src.files),
                                               split="train", **kwargs))
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as e:
        raise DataError(f"data sources {list(specs)} have different columns: {e}") from e


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
    d = dataclasses.asdict(settings)
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


def encode_sft_row(row: dict[str, Any], tokenizer, settings: DataSettings,
                   ) -> tuple[list[int], list[int]]:
    messages = row.get(settings.messages_field)
    prompt, response = row.get(settings.prompt_field), row.get(settings.response_field)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if settings.template == "chat" and not has_template:
        raise DataError("data.template=chat but the tokenizer has no chat template.")
    if messages:
        if not has_template or settings.template == "plain":
            raise DataError(f"row has '{settings.messages_field}' (chat) but "
                            + ("data.template=plain" if has_template else
                               "the tokenizer has no chat template")
                            + ": use prompt/response rows or a tokenizer with a chat template.")
        return encode_chat(list(messages), tokenizer)
    if prompt is None or response is None:
        raise DataError(f"sft row has neither '{settings.messages_field}' nor both "
                        f"'{settings.prompt_field}' and '{settings.response_field}': "
                        f"{ {k: v for k, v in row.items() if v is not None} }; set "
                        "data.prompt_field/response_field/messages_field to your column names.")
    if settings.template == "plain" or not has_template:
        return encode_plain(prompt, response, tokenizer)
    return encode_chat([{"role": "user", "content": prompt},
                        {"role": "assistant", "content": response}], tokenizer)


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


def _tokenize_split(rows, tokenizer, settings: DataSettings, num_proc: int):
    """-> (tokens [N, L+1] int32, loss_mask [N, L] uint8, stats)."""
    L = settings.seq_len
    if settings.mode == "pretrain":
        if settings.text_field not in rows.column_names:
            raise DataError(f"pretrain data has no '{settings.text_field}' column (columns: "
                            f"{rows.column_names}); set data.text_field.")
        eos = tokenizer.eos_token_id

        def tok(batch):
            ids = tokenizer(batch[settings.text_field], add_special_tokens=True)["input_ids"]
            return {"ids": [list(x) + [eos] if not x or x[-1] != eos else list(x) for x in ids]}

        docs = rows.map(tok, batched=True, remove_columns=rows.column_names,
                        num_proc=num_proc if num_proc > 1 else None, desc="tokenising")["ids"]
        tokens = pack_pretrain(docs, L)
        stats = {"documents": len(docs), "tokens": int(sum(len(d) for d in docs))}
        return tokens, np.ones((len(tokens), L), dtype=np.uint8), stats

    def enc(row):
        ids, mask = encode_sft_row(row, tokenizer, settings)
        return {"ids": ids, "mask": mask}

    out = rows.map(enc, remove_columns=rows.column_names,
                   num_proc=num_proc if num_proc > 1 else None, desc="tokenising")
    tokens, loss_mask, stats = pack_sft(list(zip(out["ids"], out["mask"], strict=True)), L,
                                        tokenizer.pad_token_id, settings.pack)
    return tokens, loss_mask, stats


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

    tokenizer = load_tokenizer(tokenizer_path)
    rows = load_rows(settings.sources)
    if settings.validation_sources:
        train_rows, val_rows = rows, load_rows(settings.validation_sources)
    elif settings.validation_split > 0:
        tr, va = split_indices(len(rows), settings.validation_split, settings.seed)
        train_rows, val_rows = rows.select(tr), rows.select(va)
    else:
        train_rows, val_rows = rows, None

    meta: dict[str, Any] = {"key": key, "format": FORMAT_VERSION,
                            "settings": dataclasses.asdict(settings),
                            "tokenizer": tokenizer_path, "vocab_size": len(tokenizer),
                            "eos_id": tokenizer.eos_token_id, "pad_id": tokenizer.pad_token_id}
    arrays = {}
    for name, part in (("train", train_rows), ("validation", val_rows)):
        if part is None:
            continue
        tokens, mask, stats = _tokenize_split(part, tokenizer, settings, num_proc)
        if name == "train" and len(tokens) == 0:
            raise DataError(f"no training sample of seq_len+1={settings.seq_len + 1} tokens could "
                            f"be built from {list(settings.sources)} ({stats}): add data or "
                            "lower train.seq_len.")
        arrays[name] = (tokens, mask)
        meta[name] = {"samples": len(tokens), **stats,
                      "max_token_id": int(tokens.max()) if len(tokens) else -1,
                      "loss_tokens": int(mask.sum())}

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
    memory-maps the cache. A failure on a writer is raised on every rank (no hang)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return prepare_data(settings, tokenizer_path, cache_dir, num_proc)
    writer = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    error = None
    if writer:
        try:
            prepare_data(settings, tokenizer_path, cache_dir, num_proc)
        except Exception as e:  # re-raised below on every rank
            error = f"{type(e).__name__}: {e}"
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        rank, msg = failed[0]
        raise DataError(f"data preparation failed on rank {rank}: {msg}")
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
