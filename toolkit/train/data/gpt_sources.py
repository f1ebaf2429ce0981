"""One megatron-core ``GPTDataset`` per pretraining source and split: Megatron's own document,
sample and shuffle indices over one epoch of the source (what Megatron-LM builds for a run that
stays inside one epoch, sample for sample).

Each (source, split) has a cache folder ``CACHE/gpt/<key>/`` holding megatron-core's files; the
key covers the index file's identity (path, sizes, modification time), the documents of the
split, the seed, the sequence length and the tokenizer facts. Collective use: global rank 0
builds the missing folders (each into a temporary sibling, renamed when complete, so a crash
never leaves a folder that looks complete), the others wait at a barrier and map them. The cache
folder must be visible to every node (as Megatron-LM's ``--data-cache-path``).

An index written by DeepSpeed (its dtype codes 6-8) is read through a copy of the ``.idx`` with
the code megatron-core uses for the same element type, beside a link to the ``.bin``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.atomic import building_once, publish_once, temp_dir, write_text
from toolkit.train.data.indexed_format import (
    IndexInfo,
    max_token_id,
    paths,
)
from toolkit.train.data.settings import DataError

FORMAT = 1
_CODE_BYTE = 17  # the dtype code, after the 9-byte magic and the 8-byte version


@dataclass(frozen=True)
class TokenizerFacts:
    """What a GPTDataset needs of the tokenizer: the EOD id (document ends), the pad id (its
    labels are masked, as in Megatron-LM; -1 when it collides with EOS) and the vocab size."""

    eod: int
    pad: int
    vocab_size: int

    @classmethod
    def of(cls, tokenizer) -> TokenizerFacts:
        eod = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        pad = tokenizer.pad_token_id
        return cls(eod, -1 if pad is None or pad == eod else int(pad), len(tokenizer))

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def unique_identifiers(self) -> dict[str, Any]:  # megatron-core hashes the config with it
        return {"class": "mdtk.TokenizerFacts", "eod": self.eod, "pad": self.pad,
                "vocab_size": self.vocab_size}


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def identity(info: IndexInfo) -> list:
    """What names an indexed dataset's content cheaply: path, sizes, modification times."""
    idx, bin_ = paths(info.prefix)
    return [str(Path(info.prefix).resolve()), idx.stat().st_size, idx.stat().st_mtime_ns,
            bin_.stat().st_size, bin_.stat().st_mtime_ns]


def _stats_path(info: IndexInfo, cache: Path) -> Path:
    return cache / "stats" / f"{_key(identity(info), FORMAT)}.json"


def token_stats(info: IndexInfo, cache: Path | None, save: bool = True) -> dict[str, int]:
    """Documents, tokens and the largest token id of a prefix; the id scan (GB/s over the
    ``.bin``) is cached per file identity under ``CACHE/stats/`` (when ``save``)."""
    path = _stats_path(info, cache) if cache else None
    if path is not None and path.is_file():
        return json.loads(path.read_text())
    stats = {"documents": info.documents, "sequences": info.sequences, "tokens": info.tokens,
             "max_token_id": max_token_id(info)}
    if path is not None and save:
        save_stats(info, cache, stats)
    return stats


def save_stats(info: IndexInfo, cache: Path, stats: dict[str, int]) -> None:
    write_text(_stats_path(info, cache), json.dumps(stats))


def readable_prefix(info: IndexInfo, cache: Path) -> str:
    """The prefix megatron-core reads: the file itself, or (DeepSpeed's codes) a Megatron-coded
    copy of its index beside a link to its ``.bin``."""
    if not info.foreign:
        return info.prefix
    folder = cache / "recoded" / _key(identity(info), FORMAT)
    prefix = folder / "data"
    if not paths(prefix)[0].is_file():
        with building_once(folder) as tmp:
            src_idx, src_bin = paths(info.prefix)
            data = bytearray(src_idx.read_bytes())
            data[_CODE_BYTE] = info.megatron_code
            (tmp / "data.idx").write_bytes(bytes(data))
            os.symlink(src_bin.resolve(), tmp / "data.bin")
    return str(prefix)


@dataclass(frozen=True)
class SourceSplit:
    """One split of one source: which of its documents (sequences) it uses."""

    name: str  # the data.sources entry (for errors and metrics)
    info: IndexInfo
    split: str  # "train" or "valid"
    documents: np.ndarray  # int32 sequence indices, sorted


def gpt_config(seq_len: int, seed: int, facts: TokenizerFacts, cache: str | None):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_len, blend=(["mdtk"], None), split="1,0,0",
        path_to_cache=cache, tokenizer=facts, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        mmap_bin_files=True)


def _folder(part: SourceSplit, seq_len: int, seed: int, facts: TokenizerFacts, cache: Path):
    digest = hashlib.sha256(part.documents.tobytes()).hexdigest()
    return cache / "gpt" / _key(identity(part.info), part.split, digest, seq_len, seed,
                                facts.unique_identifiers, FORMAT)


def open_gpt(part: SourceSplit, seq_len: int, seed: int, facts: TokenizerFacts, cache: Path,
             build: bool):
    """The GPTDataset of ``part``: built into its cache folder when ``build`` (and missing),
    else mapped from it. Without ``cache`` nothing is written (built in memory)."""
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    folder = _folder(part, seq_len, seed, facts, cache) if cache else None
    target = folder
    tmp = None
    if folder is not None and build and not folder.is_dir():
        tmp = target = temp_dir(folder)
    try:
        low = IndexedDataset(readable_prefix(part.info, cache) if cache else part.info.prefix)
        ds = GPTDataset(low, part.info.prefix, part.documents, None, Split[part.split],
                        gpt_config(seq_len, seed, facts, str(target) if target else None))
        if tmp is not None:
            publish_once(tmp, folder)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return ds


def open_all(parts: Sequence[SourceSplit], seq_len: int, seed: int, facts: TokenizerFacts,
             cache: Path | None) -> list:
    """Collective when a process group exists: rank 0 builds what is missing, then every rank
    maps (failures reach every rank)."""
    import torch.distributed as dist

    from toolkit import runtime

    with _quiet():
        if cache is None or not (dist.is_available() and dist.is_initialized()):
            return [open_gpt(p, seq_len, seed, facts, cache, build=True) for p in parts]
        with runtime.failing_together():
            if dist.get_rank() == 0:
                for p in parts:
                    if not _folder(p, seq_len, seed, facts, cache).is_dir():
                        open_gpt(p, seq_len, seed, facts, cache, build=True)
        missing = [p.name for p in parts if not _folder(p, seq_len, seed, facts, cache).is_dir()]
        if missing:
            raise DataError(f"data.cache_dir={cache} holds no GPTDataset index of {missing[0]} on "
                            "this node although rank 0 built it: put data.cache_dir on a "
                            "filesystem every node sees (as Megatron-LM's --data-cache-path).")
        return [open_gpt(p, seq_len, seed, facts, cache, build=False) for p in parts]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """megatron-core's dataset classes log every step at INFO (and warn about a single-dataset
    blend): keep their loggers at WARNING meanwhile."""
    logger = logging.getLogger("megatron.core.datasets")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
