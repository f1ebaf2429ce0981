"""megatron-core distributed checkpoints (``torch_dist``): format facts, keys, the reader.

Written by ``mcore_dist_writer``; the run folder around the iteration folder is
``megatron_layout``'s, ``common.pt``'s run arguments ``megatron_meta``'s.

Format facts (checked against megatron-core 0.16.1 and torch 2.13):
- A checkpoint folder holds ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``),
  ``common.pt`` (the non-sharded part, ``torch.save``) and PyTorch DCP files: ``.metadata``
  (a pickled ``torch.distributed.checkpoint.metadata.Metadata``) plus ``__R_I.distcp`` data
  files in which each chunk is a ``torch.save``d tensor (or raw bytes for objects).
- ``GPTModel.sharded_state_dict()`` keys are layout independent: layers are stacked along a
  leading axis (``decoder.layers.self_attention.linear_qkv.weight`` has global shape
  ``(L, out, in)``), experts along a second one (``decoder.layers.mlp.experts.experts.*``,
  ``(L, E, ...)``); norms use TE-style names from the layer spec's
  ``sharded_state_dict_keys_map`` (``KEYS_MAP``: ``input_layernorm.weight`` ->
  ``self_attention.linear_qkv.layer_norm_weight``). The global tensor of a key is the tp=1
  tensor (SwiGLU ``linear_fc1`` is ``[gate; up]``), so the tp=1 megatron tensor of layer i is
  slice i. Vocab tensors keep the padding they were saved with (global shape = padded vocab).
- Each linear module has an ``_extra_state`` ShardedObject (key ``<module>._extra_state/shard_
  <offsets>_<axes>``); the local spec stores ``[None]`` there. A tied output layer is not stored.
- ``common.pt`` holds ``args``, ``checkpoint_version`` and ``iteration`` (``megatron_meta``).
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError, formats
from toolkit.checkpoint.canonical import McoreFullSource
from toolkit.checkpoint.megatron_layout import checkpoint_dir, find_hf_config, has_checkpoint
from toolkit.checkpoint.megatron_meta import layout_of
from toolkit.checkpoint.source import ModelAdapter, Opening
from toolkit.checkpoint.torchfree import dcp_pickle, torch_record
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.checkpoint.torchfree.safe_load import load_dcp_metadata, load_plain, load_torch
from toolkit.lazy import torch
from toolkit.mapping import EXPERTS

FORMAT = "mcore"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(rf"^{re.escape(EXPERTS)}\.(\d+)\.(.*)$")


# -- keys -----------------------------------------------------------------------------------------

#: The renames of module names in sharded keys (TE-style norm names) that megatron-core's local
#: layer spec declares (``TransformerLayerSubmodules.sharded_state_dict_keys_map`` of
#: ``get_gpt_layer_local_spec``, which ``toolkit.models.layer_spec`` builds on for every family).
#: Spelled out here so naming torch_dist keys needs no megatron-core import; a test compares it
#: with the spec of every registered family.
KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def non_homogeneous(adapter: ModelAdapter) -> bool:
    """Whether megatron-core stores this model's layers under per-layer keys.

    ``TransformerBlock.sharded_state_dict`` stacks layers along a leading axis only when every
    layer is alike; with ``moe_layer_freq`` (dense and MoE layers mixed) or heterogeneous
    checkpoints each layer has its own keys (``decoder.layers.<i>.<suffix>``, experts still
    stacked along one axis).
    """
    kw = adapter.family.transformer_kwargs(adapter.hf_config)
    freq = kw.get("moe_layer_freq")
    mixed = (isinstance(freq, int) and freq > 1) or isinstance(freq, (list, tuple))
    return bool(mixed or kw.get("hetereogenous_dist_checkpoint")
                or kw.get("heterogeneous_block_specs"))


def dist_key(name: str, renames: dict[str, str], flat: bool = False
             ) -> tuple[str, tuple[int, ...]]:
    """(sharded key, offsets along the stacked axes) of a global megatron-core name.

    ``flat``: per-layer keys (see ``non_homogeneous``): the layer number stays in the key.
    """
    m = _LAYER.match(name)
    if not m:
        return name, ()
    layer, rest = int(m.group(1)), m.group(2)
    base = f"decoder.layers.{layer}." if flat else "decoder.layers."
    lead = () if flat else (layer,)
    e = _EXPERT.match(rest)
    if e:
        return f"{base}mlp.experts.experts.{e.group(2)}", (*lead, int(e.group(1)))
    for old, new in renames.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return f"{base}{rest}", lead


def stacked_axes(key: str) -> int:
    """How many leading axes of a stored key index layers / experts."""
    if re.match(r"^decoder\.layers\.\d+\.", key):  # per-layer keys
        return 1 if ".mlp.experts.experts." in key else 0
    if key.startswith("decoder.layers.mlp.experts.experts."):
        return 2
    return 1 if key.startswith("decoder.layers.") else 0


def marker(path: Path) -> bool:
    meta = path / "metadata.json"
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("sharded_backend") == "torch_dist"
    except (json.JSONDecodeError, AttributeError):
        return False


def looks_like(path: Path) -> bool:
    return has_checkpoint(path, marker)


# -- reader ---------------------------------------------------------------------------------------

@dataclass
class DistCheckpoint:
    """The parsed metadata of a torch_dist folder; tensors are read chunk by chunk on demand."""

    path: Path
    iteration: int | None
    tensors: dict[str, Any]  # key -> TensorStorageMetadata
    storage: dict[tuple[str, tuple[int, ...]], Any]  # (key, chunk offsets) -> _StorageInfo
    objects: list[str]
    common: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path) -> DistCheckpoint:
        folder, iteration = checkpoint_dir(path, marker)
        md_file = folder / ".metadata"
        if not md_file.is_file():
            raise CheckpointError(f"{folder} has metadata.json but no .metadata (incomplete "
                                  "torch_dist checkpoint).")
        md = load_dcp_metadata(md_file)
        tensors, objects = {}, []
        for key, value in md.state_dict_metadata.items():
            if isinstance(value, dcp_pickle.TensorStorageMetadata):
                tensors[key] = value
            else:
                objects.append(key)
        storage = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else ()): info
                   for idx, info in md.storage_data.items()}
        for key, value in tensors.items():
            for c in value.chunks:
                info = storage.get((key, tuple(c.offsets)))
                if info is None:
                    raise CheckpointError(f"{md_file}: chunk {tuple(c.offsets)} of {key} has no "
                                          "storage entry.")
                if getattr(info, "transform_descriptors", None):
                    raise CheckpointError(f"{folder}: chunk of {key} uses storage transforms "
                                          f"{info.transform_descriptors} (not supported).")
                data = folder / info.relative_path
                if not data.is_file():
                    raise CheckpointError(f"{data} (holding {key}) is missing.")
                if data.stat().st_size < info.offset + info.length:
                    raise CheckpointError(f"{data} is truncated: {key} needs bytes up to "
                                          f"{info.offset + info.length}, the file has "
                                          f"{data.stat().st_size}.")
        common = {}
        if (folder / "common.pt").is_file():
            common = load_plain(folder / "common.pt")  # no torch import when it can
            if common is None:
                common = load_torch(folder / "common.pt") or {}
        return cls(folder, iteration, tensors, storage, objects, common)

    def _chunk(self, key: str, offsets: tuple[int, ...],
               sizes: tuple[int, ...] | None = None) -> torch.Tensor:
        info = self.storage[(key, offsets)]
        file = self.path / info.relative_path
        if sizes is not None:
            fast = torch_record.read_tensor(file, info.offset, info.length, sizes,
                                      self.tensors[key].properties.dtype)
            if fast is not None:
                return fast
        with open(file, "rb") as f:
            f.seek(info.offset)
            buf = f.read(info.length)
        try:
            t = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure here is a damaged chunk
            raise CheckpointError(f"{file}: chunk {offsets} of {key} cannot be read "
                                  f"({err}).") from err
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{file}: chunk {offsets} of {key} is not a tensor.")
        return t

    def locate(self, key: str, prefix: tuple[int, ...]) -> tuple[Path, int] | None:
        """(file, byte offset) where the slice ``key[prefix]`` lies as one row-major block, when
        a single plain chunk holds all of it; else None (then only ``read`` can assemble it)."""
        md = self.tensors[key]
        n = len(prefix)
        size = tuple(md.size)
        for c in md.chunks:
            offs, sizes = tuple(c.offsets), tuple(c.sizes)
            if tuple(offs[n:]) != (0,) * (len(size) - n) or tuple(sizes[n:]) != size[n:]:
                continue
            if not all(o <= i < o + s for i, o, s in zip(prefix, offs, sizes, strict=False)):
                continue
            info = self.storage[(key, offs)]
            file = self.path / info.relative_path
            with open(file, "rb") as f:
                start = torch_record.tensor_start(f, info.offset, info.length, sizes,
                                            md.properties.dtype)
            if start is None:
                return None
            index, inner = 0, 1
            for s in size[n:]:
                inner *= s
            for i, o, s in zip(prefix, offs, sizes, strict=False):
                index = index * s + (i - o)
            return file, start + index * inner * md.properties.dtype.itemsize
        return None

    def read(self, key: str, prefix: tuple[int, ...]) -> torch.Tensor:
        """The slice ``key[prefix]`` (prefix = indices along the stacked axes), assembled."""
        md = self.tensors[key]
        size = tuple(md.size)
        n = len(prefix)
        want = tuple((i, i + 1) for i in prefix) + tuple((0, s) for s in size[n:])
        out = torch.empty(size[n:], dtype=to_torch(md.properties.dtype))
        filled = 0
        for c in md.chunks:
            offs, sizes = tuple(c.offsets), tuple(c.sizes)
            inter = [(max(a, o), min(b, o + s)) for (a, b), o, s in zip(want, offs, sizes,
                                                                         strict=True)]
            if any(lo >= hi for lo, hi in inter):
                continue
            data = self._chunk(key, offs, sizes)
            part = data[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, offs,
                                                                          strict=True))]
            part = part.reshape(part.shape[n:])
            if tuple(part.shape) == tuple(out.shape) and part.numel() == data.numel():
                return part  # one chunk is the whole tensor: no copy
            out[tuple(slice(lo, hi) for lo, hi in inter[n:])] = part
            filled += part.numel()
        if filled != out.numel():
            raise CheckpointError(f"{self.path}: chunks of {key}{list(prefix)} cover {filled} of "
                                  f"{out.numel()} elements.")
        return out


def full_names(ckpt: DistCheckpoint, adapter: ModelAdapter
               ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Global megatron-core name -> (sharded key, stacked-axis indices) of every stored tensor.

    Stored keys the adapter's mapping does not know come back under their own name (with a
    ``[i, ...]`` suffix) so the source reports them instead of dropping them.
    """
    renames = KEYS_MAP
    flat = any(re.match(r"^decoder\.layers\.\d+\.", k) for k in ckpt.tensors)
    known: dict[tuple[str, tuple[int, ...]], str] = {}
    for name, _ in adapter.table_at(adapter.dims.vocab).items():
        known[dist_key(name, renames, flat)] = name
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, md in ckpt.tensors.items():
        axes = stacked_axes(key)
        if axes == 0:
            out[known.get((key, ()), key)] = (key, ())
            continue
        # Only the layers / experts some chunk holds: a stacked key spans all layers, but in a
        # model mixing dense and MoE layers each layer stores only its own kind of MLP.
        held: set[tuple[int, ...]] = set()
        for c in md.chunks:
            held.update(_indices(tuple(c.sizes)[:axes], tuple(c.offsets)[:axes]))
        for prefix in sorted(held):
            name = known.get((key, prefix), f"{key}{list(prefix)}")
            out[name] = (key, prefix)
    return out


def _indices(shape: tuple[int, ...], start: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    start = start or (0,) * len(shape)
    out: list[tuple[int, ...]] = [()]
    for n, s in zip(shape, start, strict=True):
        out = [(*p, i) for p in out for i in range(s, s + n)]
    return out


def open_source(path: Path, make_adapter: formats.AdapterFactory) -> Opening:
    """A torch_dist checkpoint as an HF-named source, its adapter (``make_adapter(hf_dir,
    common)``) and info (the ``formats`` opener)."""
    ckpt = DistCheckpoint.open(path)
    adapter = make_adapter(find_hf_config(ckpt.path), {**ckpt.common, "root": ckpt.path.parent})
    names = full_names(ckpt, adapter)
    shapes = {}
    for name, (key, prefix) in names.items():
        md = ckpt.tensors[key]
        shapes[name] = (tuple(md.size)[len(prefix):], md.properties.dtype)
    source = McoreFullSource(adapter, adapter.hf_config, shapes,
                             lambda name: ckpt.read(*names[name]),
                             locate=lambda name: ckpt.locate(*names[name]))
    return Opening(source, adapter, {"iteration": ckpt.iteration, "folder": ckpt.path,
                                     "layout": layout_of(ckpt.common.get("args")),
                                     "files": sorted(p.name for p in ckpt.path.iterdir())})


formats.register(FORMAT, open_source, looks_like)  # see toolkit.checkpoint.formats
