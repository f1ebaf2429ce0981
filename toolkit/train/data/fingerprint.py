"""The cache key of tokenised data: content hashes of the sources and the tokenizer, and the
settings. It is also the data fingerprint a checkpoint records (a resume on other data is
refused), so what enters it stays stable across versions."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from toolkit.train.data.indexed_format import looks_indexed, paths, strip_suffix
from toolkit.train.data.settings import DataSettings
from toolkit.train.data.sources import resolve_sources

FORMAT_VERSION = 1
PRETRAIN_FORMAT = 2  # pretraining through Megatron indexed datasets (1: .npy blocks, <= session 6)
# Settings added after FORMAT_VERSION 1 enter the cache key only when changed from these
# defaults: the data they did not exist for tokenises the same, so its caches and the data
# fingerprints recorded in checkpoints stay valid.
_LATER_SETTINGS = {"sft_format": "auto", "conversations_field": "conversations", "weights": ()}
#: Packed SFT data since examples are bin-packed and kept apart (their boundaries recorded):
#: caches of the older packing, which let examples attend to each other, are never reused.
PACKING = "ffd-examples-2"


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


def pretrain_fingerprint(specs: Sequence[str]) -> list:
    """Per pretraining source: an indexed dataset's index bytes (hashed) and data size, or the
    content hashes of its files."""
    out: list = []
    for spec in specs:
        if looks_indexed(spec):
            idx, bin_ = paths(strip_suffix(spec))
            out.append([_sha256_file(idx), bin_.stat().st_size if bin_.is_file() else None])
        else:
            out.append(sources_fingerprint([spec]))
    return out


def cache_key(settings: DataSettings, tokenizer_path: str) -> str:
    """Also the data fingerprint a checkpoint records. Pretraining (Megatron indexed datasets
    read through GPTDataset since FORMAT 2) keys on its sources' indexes or files."""
    d = {k: v for k, v in dataclasses.asdict(settings).items()
         if k not in _LATER_SETTINGS or v != _LATER_SETTINGS[k]}
    pretrain = settings.mode == "pretrain"
    of = pretrain_fingerprint if pretrain else sources_fingerprint
    d["sources"] = of(settings.sources)
    d["validation_sources"] = of(settings.validation_sources)
    d["tokenizer"] = tokenizer_fingerprint(tokenizer_path)
    d["format"] = PRETRAIN_FORMAT if pretrain else FORMAT_VERSION
    if settings.pack and not pretrain:
        d["packing"] = PACKING
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:20]
