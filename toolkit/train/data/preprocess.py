"""Tokenise documents into Megatron indexed datasets (``PREFIX_{key}_document.bin/.idx``) with the
output of Megatron-LM's ``tools/preprocess_data.py``, byte for byte, but faster: batches of
documents (not one per call) go to worker processes that parse, tokenise with the fast (Rust)
tokenizer and pack the ids; the main process reads ahead by at most ``2 x workers`` batches and
writes in input order. Memory is bounded by the batch, not the document count (``IndexWriter``
spools the index).

What Megatron-LM does, and so what this does: a document is ``tokenizer.tokenize(text)`` (no
special tokens; with ``include_special_tokens``, the tokenizer's own BOS/EOS convention), plus
the EOS id when ``append_eod`` and the document is not empty; an empty document adds only a
document boundary; the dtype is uint16 below 65,500 tokens in the vocab, else int32.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from toolkit.train.data.fast_bpe import ByteLevelBPE
from toolkit.train.data.indexed_format import IndexWriter, dtype_for_vocab, read_index
from toolkit.train.data.readers import Batch, plan_inputs, read_batches, total_bytes
from toolkit.train.data.settings import DataError


@dataclass(frozen=True)
class TokenizeSpec:
    """How documents become ids (what a worker needs)."""

    tokenizer: str
    keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    include_special_tokens: bool = False
    dtype: str = "auto"


@dataclass
class Summary:
    outputs: dict[str, str]  # key -> prefix written
    documents: int = 0
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    skipped: bool = False  # a finished shard found in place
    max_token_id: int = -1
    vocab_size: int = 0
    dtype: str = ""
    per_key: dict[str, int] = field(default_factory=dict)


def output_prefix(prefix: str, key: str, shard: tuple[int, int] = (0, 1)) -> str:
    """Megatron-LM's name, ``{prefix}_{key}_document``; a shard adds ``_shard{i}-of-{n}``."""
    i, n = shard
    base = f"{prefix}_shard{i:05d}-of-{n:05d}" if n > 1 else prefix
    return f"{base}_{key}_document"


# -- worker side ---------------------------------------------------------------------------------
class Encoder:
    """Tokenises batches (built once per worker process)."""

    def __init__(self, spec: TokenizeSpec):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(spec.tokenizer)
        except (OSError, ValueError) as e:
            raise DataError(f"tokenizer {spec.tokenizer!r} could not be loaded: {e}") from e
        if tok.eos_token is None and spec.append_eod:
            raise DataError(f"tokenizer {spec.tokenizer!r} has no EOS token to end documents "
                            "with: drop --append-eod or use another tokenizer.")
        self.spec = spec
        self.tok = tok
        self.rust = getattr(tok, "_tokenizer", None)
        self.eod = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else None
        self.vocab_size = len(tok)
        self.dtype = dtype_for_vocab(self.vocab_size, spec.dtype)
        self.fast = None  # the exact byte-level BPE shortcut (fast_bpe), checked on first use
        if self.rust is not None and not spec.include_special_tokens:
            self.fast = ByteLevelBPE.of(self.rust)
        self.checked = False

    def slow_ids(self, texts: list[str]) -> list[list[int]]:
        """The tokenizer's own pipeline (Rust when it has one), a whole batch per call."""
        special = self.spec.include_special_tokens
        if self.rust is not None:
            encode = getattr(self.rust, "encode_batch_fast", self.rust.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=special)]
        return self.tok(texts, add_special_tokens=special)["input_ids"]

    def ids(self, texts: list[str]) -> list[list[int]]:
        if self.fast is None:
            return self.slow_ids(texts)
        out: list = [self.fast.ids(t) if self.fast.accepts(t) else None for t in texts]
        rest = [i for i, x in enumerate(out) if x is None]
        for i, ids in zip(rest, self.slow_ids([texts[i] for i in rest]), strict=True):
            out[i] = ids
        if not self.checked:  # the first batch both ways: any difference turns the shortcut off
            self.checked = True
            if out != self.slow_ids(texts):
                self.fast = None
                return self.slow_ids(texts)
        return out

    def __call__(self, batch: Batch) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        out = {}
        columns = batch.columns or _parse(batch, self.spec.keys)
        for key in self.spec.keys:
            texts = columns[key]
            for n, t in enumerate(texts):
                if not isinstance(t, str):
                    raise DataError(f"{batch.where(n)}: {key!r} is {type(t).__name__}, not "
                                    "text; fix the row or choose another key.")
            docs = self.ids(texts)
            if self.spec.append_eod:
                docs = [d + [self.eod] if d else d for d in docs]
            lengths = np.fromiter((len(d) for d in docs), np.int32, len(docs))
            flat = np.fromiter((t for d in docs for t in d), np.int64, int(lengths.sum()))
            out[key] = (flat.astype(self.dtype), lengths)
        return out


def _parse(batch: Batch, keys: Sequence[str]) -> dict[str, list]:
    cols: dict[str, list] = {k: [] for k in keys}
    for n, line in enumerate(batch.lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{batch.where(n)}: not valid JSON ({e.msg}, column {e.pos + 1}): "
                            "each line of a JSON Lines file must be one complete JSON object; "
                            "fix or remove the line.") from None
        if not isinstance(row, dict):
            raise DataError(f"{batch.where(n)}: a JSON Lines row must be an object {{...}}, got "
                            f"{type(row).__name__}.")
        for k in keys:
            if k not in row:
                raise DataError(f"{batch.where(n)}: pretrain data has no {k!r} column (columns: "
                                f"{sorted(row)}); set data.text_field (mdtk data preprocess: "
                                "--json-keys).")
            cols[k].append(row[k])
    return cols


_ENCODER: Encoder | None = None
BATCH_BYTES = 1 << 20  # about this much text per batch: enough to amortise, small to balance


def _init_worker(spec: TokenizeSpec) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker, as Megatron-LM's
    global _ENCODER
    _ENCODER = Encoder(spec)


def _encode(batch: Batch):
    assert _ENCODER is not None
    return _ENCODER(batch), len(batch), batch.nbytes


# -- main side -----------------------------------------------------------------------------------
def preprocess(inputs: Sequence[str], spec: TokenizeSpec, prefix: str, *, workers: int = 1,
               shard: tuple[int, int] = (0, 1), batch_docs: int = 1024,
               progress: bool = True, title: str = "preprocess") -> Summary:
    """Tokenise ``inputs`` (files, globs, folders, hub names) into one indexed dataset per key.
    A shard whose outputs are already complete is not redone (``Summary.skipped``)."""
    if not 0 <= shard[0] < shard[1]:
        raise DataError(f"shard {shard[0]}/{shard[1]}: use I/N with 0 <= I < N.")
    if workers < 0:
        raise DataError(f"workers={workers}: use 1 or more (0: tokenise in this process).")
    outputs = {k: output_prefix(prefix, k, shard) for k in spec.keys}
    if shard[1] > 1 and all(Path(f"{p}.idx").is_file() for p in outputs.values()):
        return _finished(outputs)
    units = plan_inputs(inputs)
    probe = Encoder(spec)  # tokenizer and dtype problems before any worker or file
    start = time.perf_counter()  # processing, as Megatron-LM's docs/s counts it
    writers = {k: IndexWriter(p, probe.dtype) for k, p in outputs.items()}
    summary = Summary(outputs, vocab_size=probe.vocab_size, dtype=probe.dtype.name)
    try:
        with _Progress(title, total_bytes(units), progress) as bar:
            for result, docs, nbytes in _run(units, spec, workers, shard, batch_docs):
                for key, (ids, lengths) in result.items():
                    writers[key].add(ids, lengths)
                    if len(ids):
                        summary.max_token_id = max(summary.max_token_id, int(ids.max()))
                summary.documents += docs
                summary.nbytes += nbytes
                bar.advance(docs, nbytes)
        for w in writers.values():
            w.finalize()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    summary.seconds = time.perf_counter() - start
    summary.per_key = {k: w.tokens for k, w in writers.items()}
    summary.tokens = sum(summary.per_key.values())
    return summary


def _finished(outputs: dict[str, str]) -> Summary:
    infos = {k: read_index(p) for k, p in outputs.items()}
    return Summary(outputs, documents=next(iter(infos.values())).documents,
                   tokens=sum(i.tokens for i in infos.values()), skipped=True,
                   dtype=next(iter(infos.values())).dtype.name)


def _run(units, spec: TokenizeSpec, workers: int, shard: tuple[int, int], batch_docs: int,
         ) -> Iterator[tuple[dict, int, int]]:
    """Encoded batches in input order: ``workers`` forked processes (as Megatron-LM's and
    ``datasets.map``'s), at most ``2 x workers`` batches in flight, while this process reads
    and writes; 0: all in this process."""
    import multiprocessing as mp

    batches = read_batches(units, spec.keys, batch_docs=batch_docs, batch_bytes=BATCH_BYTES,
                           shard=shard)
    if workers == 0:
        _init_worker(spec)
        yield from (_encode(b) for b in batches)
        return
    with mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(spec,)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode, (batch,)))
            while len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Progress:
    """A rich progress bar over the input bytes with documents, docs/s and MB/s."""

    def __init__(self, title: str, total: int, enabled: bool):
        self.title, self.enabled, self.total = title, enabled, total
        self.docs = self.nbytes = 0
        self.t0 = time.perf_counter()

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn(self.title), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                transient=False)
            self.task = self.bar.add_task(self.title, total=self.total or None, info="")
            self.bar.start()
        return self

    def advance(self, docs: int, nbytes: int) -> None:
        self.docs += docs
        self.nbytes += nbytes
        if self.enabled:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            info = (f"{self.docs:,} docs  {self.docs / dt:,.0f} docs/s  "
                    f"{self.nbytes / dt / 2**20:,.1f} MB/s")
            self.bar.update(self.task, completed=self.nbytes, info=info)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.bar.stop()
