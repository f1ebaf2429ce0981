"""Stored tensors that are no part of the megatron-core model, carried through conversions.

DeepSeek-V3 checkpoints store their multi-token-prediction (MTP) layers past
``num_hidden_layers`` (``Family.kept_aside``); transformers skips them and megatron-core's GPT
model has no place for them, yet a conversion must not drop them. They are copied unchanged
(``--dtype`` casts them as it casts the weights), one tensor at a time:

- HF -> Megatron: into ``hf_config/extras/`` of the Megatron folder (safetensors, HF names),
  next to the HF config they belong with;
- Megatron -> HF: back into the HF shards; Megatron -> Megatron: along to the new folder.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from toolkit.checkpoint.hf import HFReader
from toolkit.checkpoint.hf_writer import HFWriter
from toolkit.checkpoint.source import TensorSource
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.convert.sources import Opened, full
from toolkit.lazy import torch

EXTRAS_DIR = "extras"


class Kept(contextlib.AbstractContextManager):
    """The kept-aside tensors of an open source: from its own files (HF) or from the
    ``hf_config/extras/`` folder a Megatron checkpoint carries."""

    def __init__(self, op: Opened) -> None:
        self._reader: TensorSource = op.source
        self._own: HFReader | None = None
        self.names = op.adapter.kept(op.source.names)
        folder = op.adapter.source / EXTRAS_DIR if op.adapter.source is not None else None
        if not self.names and folder is not None and folder.is_dir():
            self._own = self._reader = HFReader(folder)
            self.names = list(self._own.names)

    def dtype(self, name: str, dtype: torch.dtype | None) -> torch.dtype:
        stored = self._reader.dtype(name)
        return dtype if dtype is not None and stored.is_floating_point else stored

    def plan(self, dtype: torch.dtype | None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (tuple(self._reader.shape(n)), self.dtype(n, dtype)) for n in self.names}

    def read(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        shape = tuple(self._reader.shape(name))
        return self._reader.read(name, full(shape)).to(to_torch(self.dtype(name, dtype)))

    def __exit__(self, *exc: object) -> None:
        if self._own is not None:
            self._own.close()


def save_kept(op: Opened, hf_config_dir: Path, dtype: torch.dtype | None) -> list[str]:
    """Copy the source's kept-aside tensors into ``hf_config_dir/extras`` (none: nothing)."""
    with Kept(op) as kept:
        if not kept.names:
            return []
        writer = HFWriter(hf_config_dir / EXTRAS_DIR, plan=kept.plan(dtype))
        try:
            for name in kept.names:
                writer.add(name, kept.read(name, dtype))
            writer.finish(None)
        except BaseException:
            writer.abort()
            raise
        return kept.names
