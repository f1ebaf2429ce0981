"""``data.mode: pretrain``: every source becomes a Megatron indexed dataset, read through
megatron-core's GPTDataset (one pretraining path).

A source is either an indexed dataset (``PREFIX`` whose ``PREFIX.idx``/``.bin`` exist, written by
Megatron-LM's ``preprocess_data.py``, ``mdtk data preprocess`` or DeepSpeed) or files / a hub
dataset, tokenised once into an indexed dataset under ``data.cache_dir/tokenized/<key>/`` (key:
file contents, tokenizer, ``data.text_field``): each document as the tokenizer encodes it with
its special tokens (its BOS convention), EOS appended, as ``mdtk data preprocess
--include-special-tokens --append-eod`` writes it. Documents are concatenated in GPTDataset's
shuffled order and cut into samples of ``seq_len + 1`` tokens that overlap by one (every token a
label once per epoch); the tail shorter than a sample is dropped; the loss mask is one except on
pad tokens (Megatron-LM's rule).

Validation: ``data.validation_sources``, or ``data.validation_split`` of each source's documents
(seeded, ``split_indices``). Training blends the sources with ``data.weights`` (normalised;
default: their sizes) as an endless stream (``blend``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.train.data.blend import Endless, IndexedSplit
from toolkit.train.data.encoding import load_tokenizer
from toolkit.train.data.fingerprint import (
    PRETRAIN_FORMAT,
    cache_key,
    sources_fingerprint,
    tokenizer_fingerprint,
)
from toolkit.train.data.gpt_sources import (
    SourceSplit,
    TokenizerFacts,
    open_all,
    save_stats,
    token_stats,
)
from toolkit.train.data.indexed_format import (
    IndexInfo,
    looks_indexed,
    read_index,
    sequence_lengths,
    strip_suffix,
)
from toolkit.train.data.settings import DataError, DataSettings
from toolkit.train.data.sources import split_indices
from toolkit.train.data.split import PreparedData


def source_info(spec: str) -> IndexInfo | None:
    """The checked index of a source that names an indexed dataset, else None (files)."""
    return read_index(strip_suffix(spec)) if looks_indexed(spec) else None


def check_weights(weights: Sequence[float], sources: Sequence[str]) -> None:
    if not weights:
        return
    if len(weights) != len(sources):
        raise DataError(f"data.weights has {len(weights)} values for {len(sources)} data.sources: "
                        "give one weight per source (or none: weights by size).")
    bad = [w for w in weights if not w > 0]
    if bad:
        raise DataError(f"data.weights={list(weights)}: every weight must be > 0 (got {bad[0]}); "
                        "remove a source instead of weighting it 0.")


def check_sources(specs: Sequence[str], mode: str) -> list[IndexInfo]:
    """The indexed sources among ``specs``, each read and checked (no token scan)."""
    infos = []
    for spec in specs:
        info = source_info(spec)
        if info is not None and mode != "pretrain":
            raise DataError(f"data source {spec} is an indexed dataset (token ids without loss "
                            "masks): it can be pretrained on (data.mode=pretrain), not used for "
                            f"{mode}.")
        if info is not None:
            infos.append(info)
    return infos


def check_token_ids(specs: Sequence[str], cache_dir: str | Path, vocab: int) -> None:
    """The largest token id of each indexed source against the model's vocab. The local rank 0
    of each node scans (once per file: the result is cached, after the check passes)."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    cache = Path(cache_dir)
    found = [(info, token_stats(info, cache, save=False)) for info in check_sources(specs,
                                                                                   "pretrain")]
    for info, stats in found:
        if stats["max_token_id"] >= vocab:
            raise DataError(
                f"data source {info.prefix}: token id {stats['max_token_id']} is at or above the "
                f"model's vocab size ({vocab}): the data was tokenised with another tokenizer; "
                "preprocess it again with this model's tokenizer (or train a model whose vocab "
                "holds it).")
    for info, stats in found:
        save_stats(info, cache, stats)


def tokenised_prefix(spec: str, settings: DataSettings, tokenizer_path: str, cache: Path,
                     num_proc: int, build: bool) -> str:
    """The cached indexed dataset of a file / hub source (tokenised here when ``build``)."""
    from toolkit.atomic import building_once
    from toolkit.train.data.preprocess import TokenizeSpec, output_prefix, preprocess

    key = hashlib.sha256(json.dumps([sources_fingerprint([spec]),
                                     tokenizer_fingerprint(tokenizer_path), settings.text_field,
                                     PRETRAIN_FORMAT]).encode()).hexdigest()[:20]
    folder = cache / "tokenized" / key
    prefix = output_prefix(str(folder / "data"), settings.text_field)
    if build and not Path(f"{prefix}.idx").is_file():
        spec_ = TokenizeSpec(tokenizer_path, (settings.text_field,), append_eod=True,
                             include_special_tokens=True)
        with building_once(folder) as tmp:
            preprocess([spec], spec_, str(tmp / "data"), workers=num_proc if num_proc > 1 else 0,
                       title=f"tokenising {Path(spec).name}")
    return prefix


def _infos(specs: Sequence[str], settings, tokenizer_path, cache, num_proc) -> list[IndexInfo]:
    """Indexed datasets of ``specs`` (files tokenised by the local rank 0 of each node first)."""
    import torch.distributed as dist

    from toolkit import runtime

    files = [s for s in specs if not looks_indexed(s)]
    if files:
        local0 = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized()
                                    else 0)) == 0
        with runtime.failing_together():
            if local0:
                for s in files:
                    tokenised_prefix(s, settings, tokenizer_path, cache, num_proc, build=True)
    return [read_index(strip_suffix(s)) if looks_indexed(s) else
            read_index(tokenised_prefix(s, settings, tokenizer_path, cache, num_proc, False))
            for s in specs]


def _parts(specs, infos, split: str, fraction: float, seed: int, pick: int
           ) -> list[SourceSplit]:
    """Each source's documents of ``split`` (pick 0: the training part, 1: the held-out)."""
    out = []
    for spec, info in zip(specs, infos, strict=True):
        docs = np.arange(info.sequences, dtype=np.int32)
        if fraction > 0:
            docs = split_indices(info.sequences, fraction, seed)[pick].astype(np.int32)
        out.append(SourceSplit(spec, info, split, docs))
    return out


def _normalised(weights: Sequence[float]) -> list[float] | None:
    if not weights:
        return None
    from megatron.core.datasets.utils import normalize

    return normalize(list(weights))


def _check_samples(parts: Sequence[SourceSplit], datasets, seq_len: int) -> None:
    for part, ds in zip(parts, datasets, strict=True):
        if len(ds) < 1:
            raise DataError(f"no {part.split} sample of seq_len+1={seq_len + 1} tokens could be "
                            f"built from {part.name} ({len(part.documents)} documents, "
                            f"{part.info.tokens} tokens in the source): add data or lower "
                            "train.seq_len.")


def prepare(settings: DataSettings, tokenizer_path: str, cache_dir: str | Path,
            num_proc: int = 1):
    """Collective when a process group exists (every rank calls it)."""

    cache = Path(cache_dir)
    check_weights(settings.weights, settings.sources)
    facts = TokenizerFacts.of(load_tokenizer(tokenizer_path))
    train_infos = _infos(settings.sources, settings, tokenizer_path, cache, num_proc)
    fraction = 0.0 if settings.validation_sources else settings.validation_split
    train = _parts(settings.sources, train_infos, "train", fraction, settings.seed, 0)
    if settings.validation_sources:
        val_infos = _infos(settings.validation_sources, settings, tokenizer_path, cache, num_proc)
        val = _parts(settings.validation_sources, val_infos, "valid", 0.0, settings.seed, 0)
    elif fraction > 0:
        val = _parts(settings.sources, train_infos, "valid", fraction, settings.seed, 1)
    else:
        val = []
    gpts = open_all(train + val, settings.seq_len, settings.seed, facts, cache)
    _check_samples(train, gpts[:len(train)], settings.seq_len)
    streams = [Endless(g, settings.seed, i) for i, g in enumerate(gpts[:len(train)])]
    # normalised once here and once more by BlendedDataset, as Megatron-LM's builder does:
    # the same floats, so the same blending indices
    weights = _normalised(settings.weights)
    train_split = IndexedSplit(settings.sources, streams, weights, stream=True,
                               seq_len=settings.seq_len, cache=cache)
    val_split = None
    if val:
        kept = [(p, g) for p, g in zip(val, gpts[len(train):], strict=True) if len(g)]
        if not kept:
            raise DataError(f"the validation documents make no sample of seq_len+1="
                            f"{settings.seq_len + 1} tokens: raise data.validation_split, add "
                            "data.validation_sources or lower train.seq_len.")
        val_split = IndexedSplit([p.name for p, _ in kept], [g for _, g in kept], None,
                                 stream=False, seq_len=settings.seq_len)
    key = cache_key(settings, tokenizer_path)
    meta = _meta(settings, tokenizer_path, facts, key, cache)
    meta["train"] = _describe(train, train_split, cache)
    if val_split is not None:
        meta["validation"] = _describe(val, val_split, cache)
    return PreparedData(train_split, val_split, key, cache, meta)


def _meta(settings, tokenizer_path, facts, key, cache) -> dict[str, Any]:
    return {"key": key, "format": PRETRAIN_FORMAT, "settings": dataclasses.asdict(settings),
            "tokenizer": tokenizer_path, "vocab_size": facts.vocab_size, "eos_id": facts.eod,
            "pad_id": facts.pad}


def _describe(parts: Sequence[SourceSplit], split: IndexedSplit, cache: Path) -> dict[str, Any]:
    """The split's sources, documents, samples and largest token id (the trainer checks it
    against the model's vocab)."""
    stats = [token_stats(p.info, cache) for p in parts]
    return {"samples": len(split), "sources": [p.name for p in parts],
            "documents": int(sum(len(p.documents) for p in parts)),
            "tokens": int(sum(sequence_lengths(p.info)[p.documents].sum(dtype=np.int64)
                              for p in parts)),
            "max_token_id": max(s["max_token_id"] for s in stats)}
