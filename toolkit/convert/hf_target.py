"""The HF target: safetensors shards streamed tensor by tensor, then config and side files.

The shard layout is planned up front (``HFWriter(plan=...)``), so each tensor goes to its file as
soon as it is read and memory holds one tensor. A source whose HF config transformers wrote
(it names a ``transformers_version``; carried unchanged through mdtk's Megatron formats) and
that has a ``generation_config.json`` gets both back as they are, with the weights' dtype
(``hfconfig.config_text``): no transformers import, which is ~2 s of a conversion's start-up (more
than a 1B model's data copy). Other sources (an HF config mdtk derived from Megatron-LM's args;
no generation config) have them written by transformers' own config classes, which fill in
transformers' defaults, imported in a thread while the data is copied (from the source's
``ModelSpec``: no second read, no second mapping).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkit.adapters.spec import ConfigFile
from toolkit.checkpoint.hf import GENERATION_CONFIG
from toolkit.checkpoint.hf_writer import HFWriter, TextFile
from toolkit.checkpoint.pipeline import background, read_ahead
from toolkit.checkpoint.stacked import StackingWriter, stored_plan
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.checkpoint.torchfree.segments import will_need
from toolkit.convert.extras import Kept
from toolkit.convert.progress import Progress
from toolkit.convert.sources import Opened, full
from toolkit.lazy import torch


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
    configs = _configs(op, out_dtype)  # a call; transformers' import, if any, runs meanwhile
    plan = {n: (tuple(s), dtype_of(n)) for n, s in expected.items()}
    stacks = op.adapter.stacks  # GPT-OSS's fused experts: members gathered, then written
    writer = HFWriter(dst, overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                      plan=stored_plan({**plan, **kept.plan(dtype)}, stacks))
    writer.fsync = fsync
    if stacks:
        writer = StackingWriter(writer, stacks)
    segments = getattr(op.source, "segments", None)
    stored_dtype = op.dtype_of(None)
    members = {m.name for stack in stacks for m in stack.members}  # never copied as bytes

    def produce(name: str) -> torch.Tensor | list:
        if name in kept.names:
            return kept.read(name, dtype)
        if segments is not None and dtype_of(name) == stored_dtype(name) and name not in members:
            found = segments(op.names[name])
            if found is not None:
                will_need(found)  # the disk reads them while the current tensor is copied
                return found  # byte ranges of the source: copied file to file, not read
        return op.read(name, full(expected[name])).to(to_torch(dtype_of(name)))

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


def _configs(op: Opened, dtype: torch.dtype) -> Callable[[], tuple[Any, Any]]:
    """A call giving the config and generation config to write: the source's as they are when
    transformers wrote them (see the module docstring), else transformers' rendering of the
    source's HF config folder, started now in a thread and awaited by the call."""
    spec = op.spec
    src = spec.source
    generation = src is not None and (src / GENERATION_CONFIG).is_file()
    if spec.foreign or (generation and "transformers_version" in spec.config):
        # a model type transformers reads with another class (Kimi K2): written as read too
        found = (ConfigFile(spec.config, dtype),
                 TextFile(GENERATION_CONFIG, (src / GENERATION_CONFIG).read_text())
                 if generation else None)
        return lambda: found

    def render() -> tuple[Any, Any]:
        from toolkit.adapters.adapter import export_config
        from toolkit.adapters.live import generation_config

        made = spec.transformers_config()
        return ConfigFile(export_config(made, dtype)), generation_config(src, made)

    return background(render)
