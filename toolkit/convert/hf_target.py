"""The HF target: safetensors shards streamed tensor by tensor, then config and side files.

The shard layout is planned up front (``HFWriter(plan=...)``), so each tensor goes to its file as
soon as it is read and memory holds one tensor. ``config.json`` and ``generation_config.json``
are written by transformers' own config classes (the one place the converter imports
transformers), from the HF config folder of the source.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from toolkit.checkpoint.hf import HFWriter
from toolkit.checkpoint.pipeline import background, read_ahead
from toolkit.convert.extras import Kept
from toolkit.convert.progress import Progress
from toolkit.convert.sources import Opened, full


def write_hf(op: Opened, dst: Path, dtype: torch.dtype | None, bar: Progress, *,
             overwrite: bool, max_shard_bytes: int, fsync: bool) -> None:
    """Write the open source as an HF folder at ``dst`` (floating tensors cast to ``dtype``);
    tensors no model holds (``toolkit.convert.extras``: MTP layers) are copied back too."""
    with Kept(op) as kept:
        _write_hf(op, kept, dst, dtype, bar, overwrite=overwrite,
                  max_shard_bytes=max_shard_bytes, fsync=fsync)


def _write_hf(op: Opened, kept: Kept, dst: Path, dtype: torch.dtype | None, bar: Progress, *,
              overwrite: bool, max_shard_bytes: int, fsync: bool) -> None:
    dtype_of = op.dtype_of(dtype)
    expected = op.adapter.expected_tensors()
    out_dtype = dtype or dtype_of(next(iter(expected)))
    configs = background(lambda: _configs(op, out_dtype))  # imports transformers meanwhile
    plan = {n: (tuple(s), dtype_of(n)) for n, s in expected.items()}
    writer = HFWriter(dst, overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                      plan={**plan, **kept.plan(dtype)})
    writer.fsync = fsync
    segments = getattr(op.source, "segments", None)
    stored_dtype = op.dtype_of(None)

    def produce(name: str) -> torch.Tensor | list:
        if name in kept.names:
            return kept.read(name, dtype)
        if segments is not None and dtype_of(name) == stored_dtype(name):
            found = segments(op.names[name])
            if found is not None:
                return found  # byte ranges of the source: copied file to file, not read
        return op.read(name, full(expected[name])).to(dtype_of(name))

    try:
        # the next tensor is read (in a thread) while this one is written: two in memory
        names = {**expected, **dict.fromkeys(kept.names)}
        with contextlib.closing(read_ahead(names, produce)) as tensors:
            for name, t in tensors:
                if isinstance(t, list):
                    writer.add_segments(name, t)
                    bar.advance(sum(n for _, _, n in t))
                else:
                    writer.add(name, t)
                    bar.advance(t.numel() * t.element_size())
                del t
        config, gen = configs()
        writer.finish(config, generation_config=gen, copy_from=op.adapter.source)
    except BaseException:
        writer.abort()
        raise


def _configs(op: Opened, dtype: torch.dtype) -> tuple[Any, Any]:
    """transformers' config and generation config of the source's HF config folder (so
    config.json is written as transformers writes it), with the weights' dtype."""
    from toolkit.adapters import adapter_for
    from toolkit.adapters.live import generation_config

    live = adapter_for(op.adapter.source)
    return live.export_config(dtype), generation_config(live)
