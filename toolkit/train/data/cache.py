"""The tokenised samples on disk: one cache folder per key (written to a temporary sibling and
renamed), memory-mapped by every rank; prepared once per node in a distributed run."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.atomic import building_once
from toolkit.train.data import segments
from toolkit.train.data.encoding import load_tokenizer
from toolkit.train.data.fingerprint import FORMAT_VERSION, cache_key
from toolkit.train.data.modes import MODES, SFT_ROWS, tokenize_split
from toolkit.train.data.progress import datasets_quiet
from toolkit.train.data.settings import DataError, DataSettings
from toolkit.train.data.sources import RowsPart, load_parts, split_parts
from toolkit.train.data.split import PreparedData, TokenizedSplit

#: Arrays a mode may add beside tokens and loss mask (``{split}_{name}.npy``): SFT's packing,
#: a reward pair's margin, KTO's label and what its KL rows are made of.
EXTRA_ARRAYS = ("examples", "row_offsets", "margin", "label", "prompt_len", "completion",
                "completion_len")


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _load(path: Path) -> PreparedData:
    meta = json.loads((path / "meta.json").read_text())

    packed = meta["settings"]["mode"] in SFT_ROWS and bool(meta["settings"].get("pack"))

    def split(name: str) -> TokenizedSplit | None:
        if not (path / f"{name}_tokens.npy").exists():
            return None
        extra = {k: np.load(path / f"{name}_{k}.npy", mmap_mode="r") for k in EXTRA_ARRAYS
                 if (path / f"{name}_{k}.npy").exists()}
        return TokenizedSplit(np.load(path / f"{name}_tokens.npy", mmap_mode="r"),
                              np.load(path / f"{name}_loss_mask.npy", mmap_mode="r"), extra,
                              packed=packed)

    train = split("train")
    assert train is not None, f"{path} lacks train arrays"  # meta.json is written after them
    return PreparedData(train, split("validation"), meta["key"], path, meta)


def _build(settings: DataSettings, tokenizer_path: str, key: str, num_proc: int,
           ) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
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
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for name, split in (("train", parts), ("validation", val_parts)):
        if split is None:
            continue
        tokens, mask, stats, *more = tokenize_split(split, tokenizer, settings, num_proc, name)
        extra = more[0] if more else {}
        if name == "train" and len(tokens) == 0:
            raise DataError(f"no training sample of seq_len+1={settings.seq_len + 1} tokens could "
                            f"be built from {list(settings.sources)} ({stats}): add data or "
                            "lower train.seq_len.")
        arrays[name] = {"tokens": tokens, "loss_mask": mask, **extra}
        meta[name] = {"samples": len(tokens), **stats,
                      "max_token_id": int(tokens.max()) if len(tokens) else -1,
                      "loss_tokens": int(mask.sum())}
        if "examples" in extra:
            meta[name].update(segments.pack_summary(extra["examples"], extra["row_offsets"],
                                                    settings.seq_len + 1))
    return meta, arrays


def prepare_data(settings: DataSettings, tokenizer_path: str, cache_dir: str | Path,
                 num_proc: int = 1) -> PreparedData:
    """Tokenise (or reuse the cache keyed by source contents + tokenizer + settings).

    Single-process and idempotent; the cache folder is written to a temporary sibling and
    renamed, so a crashed or concurrent writer never leaves a half-written entry behind."""
    if settings.mode not in MODES:
        raise DataError(f"data.mode={settings.mode!r}: choose {' or '.join(MODES)}.")
    if settings.mode == "pretrain":  # Megatron indexed datasets (pretrain.py), not .npy samples
        from toolkit.train.data.pretrain import prepare

        return prepare(settings, tokenizer_path, cache_dir, num_proc)
    key = cache_key(settings, tokenizer_path)
    cache = Path(cache_dir)
    final = cache / key
    if (final / "meta.json").is_file():
        return _load(final)

    with datasets_quiet():
        meta, arrays = _build(settings, tokenizer_path, key, num_proc)
    with building_once(final) as tmp:  # a concurrent writer's entry would be identical
        for name, named in arrays.items():
            for what, array in named.items():
                _save_npy(tmp / f"{name}_{what}.npy", array)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return _load(final)


def prepare_data_distributed(settings: DataSettings, tokenizer_path: str, cache_dir: str | Path,
                             num_proc: int = 1) -> PreparedData:
    """Collective: local rank 0 of each node tokenises (or hits the cache), then every rank
    memory-maps the cache. A failure on a writer is raised on every rank (no hang): its
    ``DataError`` as it is, so the run reports it once."""
    import torch.distributed as dist

    from toolkit import runtime

    if settings.mode == "pretrain" or not (dist.is_available() and dist.is_initialized()):
        return prepare_data(settings, tokenizer_path, cache_dir, num_proc)  # pretrain: collective
    with runtime.failing_together():
        if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:
            prepare_data(settings, tokenizer_path, cache_dir, num_proc)
    return prepare_data(settings, tokenizer_path, cache_dir, num_proc)
