"""Any checkpoint the format registry knows, opened as HF-named tensors through its adapter.

``toolkit.checkpoint.formats`` recognises and opens each format; here the model's description
(``ModelSpec``) is made for it, from the HF config folder the checkpoint carries (or
``--hf-config``, or for Megatron-LM's own checkpoints the one derived from its args:
``megatron_lm``) read as plain JSON (no transformers import), or given by the caller (``Ctx.spec``:
a converter's worker, the read-back of a result, the trainer's own spec), and the stored tensor
names are matched against its mapping, so a checkpoint that does not fit its config.json fails
here, naming the files that differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.adapters import Adapter, CheckpointMismatch, ModelSpec
from toolkit.checkpoint import CheckpointError, formats
from toolkit.checkpoint.source import Region, TensorSource
from toolkit.convert.megatron_lm import derived_hf_folder
from toolkit.lazy import torch


def full(shape: tuple[int, ...]) -> Region:
    """The region covering a whole tensor."""
    return tuple((0, n) for n in shape)


@dataclass(frozen=True)
class Ctx:
    """What a worker process needs to reopen the source (picklable). ``spec``: the model, once
    read (then no config.json is read again and its mapping is the spec's); else it is read
    from the checkpoint (``live``: as a model to run, ``ModelSpec.live``). ``dtype``: the
    output's (``--dtype``) and the mapping's."""

    fmt: str
    src: str
    hf_config: str | None
    dtype: torch.dtype | None
    vocab_multiple: int
    spec: ModelSpec | None = None
    live: bool = False


@dataclass
class Opened:
    """An open checkpoint: ``source`` (close it when done), the model (``spec``) and its
    mapping (``adapter``), the format's info."""

    source: TensorSource
    adapter: Adapter
    info: dict
    names: dict[str, str]  # expected HF name -> stored name
    spec: ModelSpec

    def read(self, name: str, region: Any) -> torch.Tensor:
        return self.source.read(self.names[name], tuple(region))

    def byte_range(self, name: str, region: Any, dtype: torch.dtype
                   ) -> tuple[Any, int, int] | None:
        """``(file, offset, length)`` of ``region`` of ``name`` as stored, when the source can
        say (HF safetensors: whole rows) and stores it as ``dtype`` (no cast); else None."""
        stored = self.names[name]
        locate = getattr(self.source, "byte_range", None)
        if locate is None or self.source.dtype(stored) != dtype:
            return None
        return locate(stored, tuple(region))

    def dtype_of(self, dtype: torch.dtype | None) -> Callable[[str], torch.dtype]:
        """name -> output dtype: ``dtype`` for floating tensors when given, else as stored."""
        def of(name: str) -> torch.dtype:
            stored = self.source.dtype(self.names[name])
            return dtype if dtype is not None and stored.is_floating_point else stored
        return of


def adapter_from_folder(folder: str | Path, vocab_multiple: int = 1) -> Adapter:
    """The converter's adapter of the ``config.json`` in ``folder`` (read as plain JSON)."""
    return ModelSpec.of(Path(folder)).adapter(vocab_multiple=vocab_multiple)


def adapter_factory(ctx: Ctx, found: list[ModelSpec] | None = None) -> formats.AdapterFactory:
    """A format opener's ``make_adapter(found_hf_dir, common)``: the mapping of ``ctx.spec``, or
    of the checkpoint's own HF config folder, of ``ctx.hf_config`` (``--hf-config``) or of the
    config derived from Megatron-LM's args; the spec is appended to ``found``."""
    found = [] if found is None else found

    def make(folder: Path | None, common: dict) -> Adapter:
        spec = ctx.spec
        if spec is None:
            folder = ctx.hf_config or folder
            if folder is None:  # Megatron-LM's own checkpoint: the model from its args
                folder = derived_hf_folder(common)
            spec = ModelSpec.of(Path(folder), live=ctx.live)
        found.append(spec)
        return spec.adapter(ctx.dtype, ctx.vocab_multiple)
    return make


def detect(path: str | Path) -> str:
    """The format name of a checkpoint folder (``toolkit.checkpoint.formats.detect``)."""
    return formats.detect(path)


def open_ctx(ctx: Ctx) -> Opened:
    """Open ``ctx.src`` and match its tensors to the adapter (``vocab_multiple`` applied)."""
    found: list[ModelSpec] = []
    opening = formats.get(ctx.fmt).open(Path(ctx.src), adapter_factory(ctx, found))
    source, adapter, info = opening.source, opening.adapter, opening.info
    if ctx.dtype is not None and hasattr(source, "dequantize_to"):
        source.dequantize_to(ctx.dtype)  # fp8 weights: the product rounded once, into --dtype
    try:
        stored = {n: tuple(source.shape(n)) for n in source.names}
        try:
            names = adapter.match_checkpoint(stored)
        except CheckpointMismatch as err:
            raise CheckpointError(f"{ctx.src}: {err}{_where(source, adapter, stored)}") from err
    except BaseException:
        source.close()
        raise
    return Opened(source, adapter, info, names, found[0])


def open_checkpoint(path: str | Path, hf_config: str | Path | None = None,
                    fmt: str | None = None, *, spec: ModelSpec | None = None,
                    dtype: Any = None, live: bool = False) -> Opened:
    """Any supported checkpoint folder as HF-named tensors: ``.read(name, region)``,
    ``.adapter``, ``.spec``, ``.info``, ``.source`` (close it when done). ``fmt`` defaults to
    detection; ``spec``: the model, already read; the mapping is the model's in ``dtype``
    (default: the declared one); ``live``: read the model as one to run."""
    path = Path(path)
    return open_ctx(Ctx(fmt or detect(path), str(path), str(hf_config) if hf_config else None,
                        dtype, 1, spec, live))


def _where(source: TensorSource, adapter: Adapter, stored: dict[str, tuple[int, ...]]) -> str:
    """`` (in FILE, ...)``: the files holding tensors whose shapes differ from config.json."""
    locate = getattr(source, "locate", None)
    if locate is None:
        return ""
    prefix = adapter.family.base_prefix
    files = []
    for name, shape in adapter.expected_tensors().items():
        bare = name[len(prefix):] if prefix and name.startswith(prefix) else name
        key = name if name in stored else bare
        if key in stored and tuple(stored[key]) != tuple(shape):
            f = str(locate(key))
            if f not in files:
                files.append(f)
    return f" (in {', '.join(files[:4])})" if files else ""
