"""A model for generation or evaluation, loaded at this launch's layout from any source mdtk
reads: an HF folder or hub id, a checkpoint the format registry opens (megatron-core torch_dist
of any layout, legacy Megatron, a full `mdtk train` checkpoint: step folder or checkpoint root),
or the LoRA / DoRA adapters of a run (an HF PEFT folder or an adapter checkpoint) on their base.

Each rank builds its chunks for the layout and reads only its slices (the converter's readers
behind the model's mapping), as training loads a model; nothing is gathered on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolkit.adapters import Adapter, ModelSpec
from toolkit.errors import UserError
from toolkit.parallel import ParallelLayout

LATEST = "latest"  # a checkpoint root's pointer to its newest step folder


class LoadError(UserError):
    """A model source mdtk cannot load for generation (what it is, what is missing)."""


@dataclass
class Loaded:
    """This rank's model: its chunks, mapping and description, its tokenizer and end ids."""

    chunks: list[Any]
    adapter: Adapter
    spec: ModelSpec
    tokenizer: Any
    eos_ids: list[int]
    max_positions: int  # the longest prompt + completion the model takes

    @classmethod
    def of(cls, chunks: list[Any], adapter: Adapter, spec: ModelSpec, tokenizer: Any,
           folder: Path) -> Loaded:
        """Chunks already built (a load, or a training run's live ones) with what generation
        reads from the model: its end ids (``folder``'s generation config first) and length."""
        return cls(chunks, adapter, spec, tokenizer, eos_ids(spec, folder, tokenizer),
                   int(spec.config.get("max_position_embeddings") or 2048))


def load(source: str, layout: ParallelLayout, *, dtype: torch.dtype | None = None,
         tokenizer: str | None = None) -> Loaded:
    """``source`` at ``layout`` (megatron-core's groups made for it), in ``dtype`` (default:
    the model's declared one); ``tokenizer``: a folder or hub id (default: the model's own,
    or the tokenizer files a checkpoint's ``hf_config/`` carries)."""
    from toolkit.adapters import live
    from toolkit.convert.adapters import find_adapter, is_adapter

    path = _step(_resolve(source))
    if is_adapter(path):
        folder, base = find_adapter(path)
        if not base:
            raise LoadError(f"{source}: LoRA adapters whose base model is not recorded: load "
                            "the base and give the adapters through a PEFT folder that names it "
                            "(base_model_name_or_path).")
        words = _resolve(base)
        spec = ModelSpec.of(words, live=True)
        chunks, adapter = live.load_hf(spec, layout, dtype=dtype)
        _attach(chunks, adapter, folder)
    elif _is_hf_folder(path):
        spec, words = ModelSpec.of(path, live=True), path
        chunks, adapter = live.load_hf(spec, layout, dtype=dtype)
    else:
        chunks, adapter, spec = _from_checkpoint(path, layout, dtype)
        words = spec.source or path
    tok = _tokenizer(tokenizer, words, source)
    return Loaded.of(chunks, adapter, spec, tok, words)


def _resolve(source: str) -> Path:
    from toolkit.adapters import live

    try:
        return live.resolve_source(source)
    except FileNotFoundError as e:
        raise LoadError(str(e)) from None


def _step(path: Path) -> Path:
    """A checkpoint root as its newest step folder."""
    latest = path / LATEST
    return path / latest.read_text().strip() if latest.is_file() else path


def _is_hf_folder(path: Path) -> bool:
    from toolkit.checkpoint.hf import looks_like

    return looks_like(path)


def _from_checkpoint(path: Path, layout: ParallelLayout,
                     dtype: torch.dtype | None) -> tuple[list[Any], Adapter, ModelSpec]:
    from toolkit.adapters import live
    from toolkit.checkpoint import CheckpointError
    from toolkit.convert.sources import open_checkpoint

    try:
        opened = open_checkpoint(path, dtype=dtype, live=True)
    except CheckpointError as e:
        raise LoadError(f"{path}: not a model mdtk can load ({e}).") from None
    try:
        adapter = opened.adapter
        adapter.validate(layout)
        chunks = live.build_model(adapter, live.layout_in_use(layout))
        live.fill_chunks(chunks, adapter, opened.source, names=opened.names)
    finally:
        opened.source.close()
    return chunks, adapter, opened.spec


def _attach(chunks: list[Any], adapter: Adapter, folder: Path) -> None:
    """The adapters of a PEFT folder on the loaded base (applied, not merged)."""
    from megatron.core import parallel_state as ps

    from toolkit.adapters.live import current_coord
    from toolkit.lora import LoraError
    from toolkit.lora.attach import attach, folder_source
    from toolkit.lora.peft_io import read_config
    from toolkit.lora.targets import adapter_spec

    try:
        spec, _ = read_config(folder)
        spec = adapter_spec(adapter, spec)
        attach(chunks, adapter, spec, current_coord(), folder_source(folder, adapter, spec),
               tp_group=ps.get_tensor_model_parallel_group())
    except LoraError as e:
        raise LoadError(f"{folder}: {e}") from None


def _tokenizer(given: str | None, model: Path, source: str) -> Any:
    from transformers import AutoTokenizer

    candidates = [given] if given else [str(model), str(model / "hf_config")]
    for where in candidates:
        try:
            return AutoTokenizer.from_pretrained(where)
        except (OSError, ValueError):
            continue
    raise LoadError(f"{source}: no tokenizer found ({', '.join(candidates)}): give one with "
                    "--tokenizer (a folder or hub id).")


def eos_ids(spec: ModelSpec, model: Path, tokenizer: Any) -> list[int]:
    """The ids that end a completion: generation_config.json's, else config.json's, else the
    tokenizer's (one or a list, as transformers reads them)."""
    import json

    found: Any = None
    gen = model / "generation_config.json"
    if gen.is_file():
        found = json.loads(gen.read_text()).get("eos_token_id")
    if found is None:
        found = spec.config.get("eos_token_id")
    if found is None:
        found = tokenizer.eos_token_id
    ids = found if isinstance(found, list) else [found]
    return [int(i) for i in ids if i is not None]
