"""megatron-core ``torch_dist`` checkpoints written offline (the format: ``mcore_dist``).

A conversion plans one chunk per layer / expert of every tensor (``plan_items``), writes them
into DCP data files (``write_data_file``: each chunk a ``torch.save`` record, copied file to
file from the source's byte ranges where it can), then the metadata (``write_metadata``:
``.metadata``, the ``_extra_state`` objects, ``metadata.json``, ``common.pt``), all without
importing torch on the byte-copy path.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.checkpoint.canonical import local_segments, local_tensor
from toolkit.checkpoint.mcore_dist import BACKEND, KEYS_MAP, dist_key, non_homogeneous
from toolkit.checkpoint.megatron_meta import extra_state_module
from toolkit.checkpoint.pipeline import read_ahead
from toolkit.checkpoint.source import ModelAdapter
from toolkit.checkpoint.torchfree import dcp_pickle, torch_record
from toolkit.checkpoint.torchfree.segments import merge, will_need
from toolkit.lazy import torch


@dataclass(frozen=True)
class Item:
    """One chunk to write: the tp=1 tensor of ``name`` at ``prefix`` of sharded key ``key``."""

    name: str
    key: str
    prefix: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    axes: tuple[int, ...] = ()  # sizes of the stacked axes ``prefix`` indexes


def plan_items(adapter: ModelAdapter, tp: int, dtype_of: Callable[[str], torch.dtype]
               ) -> list[Item]:
    """Every tensor chunk of the checkpoint (one per layer / expert), in table order."""
    renames = KEYS_MAP
    flat = non_homogeneous(adapter)
    table = adapter.table(tp)
    d = adapter.dims
    items = []
    for name, rule in table.items():
        if name == "output_layer.weight" and table.tied:
            continue  # megatron-core stores the tied output layer as the embedding
        key, prefix = dist_key(name, renames, flat)
        axes = ((d.experts,) if flat else (d.layers, d.experts))[: len(prefix)]
        shape = rule.local_shape(1)
        numel = 1
        for s in shape:
            numel *= s
        items.append(Item(name, key, prefix, shape,
                          numel * dtype_of(rule.sources[0]).itemsize, axes))
    return items


def write_data_file(path: Path, items: list[Item], table: Any, read: Callable,
                    dtype_of: Callable[[str], torch.dtype],
                    tick: Callable[[int], None] = lambda n: None,
                    byte_range: Callable[[str, Any, torch.dtype], Any] | None = None
                    ) -> list[dict]:
    """Write ``items`` into one DCP data file; returns their storage records.

    ``byte_range(name, region, dtype)`` (optional): where a source region lies as stored
    (``Opened.byte_range``). An item made of whole rows of such regions (every layer tensor,
    ``[gate; up]``, fused QKV, the embedding of a safetensors source without a cast) is copied
    file to file into its ``torch.save`` record (``torch_record``); the others are assembled in
    memory, the next one read in a thread while this one is written."""
    rules = dict(table.items())
    records = []

    def produce(it: Item) -> Any:
        rule = rules[it.name]
        dtype = dtype_of(rule.sources[0])
        if byte_range is not None:
            segs = local_segments(rule, 0, 1, lambda n, r: byte_range(n, r, dtype),
                                  dtype.itemsize)
            if segs is not None:
                segs = merge(segs)
                will_need(segs)  # the disk reads them while the current chunk is copied
                return segs, dtype
        t = local_tensor(rule, 0, 1, read, dtype)
        return t.reshape((1,) * len(it.prefix) + tuple(t.shape)).contiguous()

    # the next chunk is read (in a thread) while this one is written: two chunks in memory
    with open(path, "wb") as f, contextlib.closing(read_ahead(items, produce)) as chunks:
        for it, t in chunks:
            offset = f.tell()
            shape = (1,) * len(it.prefix) + tuple(it.shape)
            if isinstance(t, tuple):
                f.flush()
                torch_record.save_segments(f.fileno(), shape, t[1], t[0])
                f.seek(0, 2)  # the buffered file learns the position the copies moved to
                dtype = t[1]
            else:
                torch.save(t, f)
                shape, dtype = tuple(t.shape), t.dtype
            records.append({"key": it.key, "offsets": (*it.prefix, *(0,) * len(it.shape)),
                            "sizes": shape, "dtype": dtype, "file": path.name,
                            "offset": offset, "length": f.tell() - offset})
            tick(it.nbytes)
            del t
    return records


def write_metadata(folder: Path, items: list[Item], records: list[dict], num_layers: int,
                   num_experts: int, common: dict[str, Any]) -> None:
    """``.metadata`` (DCP; pickled from ``dcp_pickle``'s stand-ins, so torch.distributed is not
    imported), the ``_extra_state`` objects file, ``metadata.json``, ``common.pt``."""
    d = dcp_pickle
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    chunks: dict[str, list] = {}
    for r in records:
        chunks.setdefault(r["key"], []).append(r)
    shapes: dict[str, tuple[int, ...]] = {}
    for it in items:
        shapes[it.key] = (*it.axes, *it.shape)
    for key, rs in chunks.items():
        md_chunks = []
        for i, r in enumerate(rs):
            md_chunks.append(d.ChunkStorageMetadata.make(offsets=d.Size(r["offsets"]),
                                                         sizes=d.Size(r["sizes"])))
            storage[d.MetadataIndex.make(fqn=key, index=i, offset=d.Size(r["offsets"]))] = \
                d.StorageInfo.make(relative_path=r["file"], offset=r["offset"],
                                   length=r["length"])
        props = d.TensorProperties.make(dtype=d.dtype_ref(rs[0]["dtype"]), layout=d.STRIDED,
                                        requires_grad=False, memory_format=d.CONTIGUOUS,
                                        pin_memory=False)
        state[key] = d.TensorStorageMetadata.make(properties=props, size=d.Size(shapes[key]),
                                                  chunks=md_chunks)
    # _extra_state of every linear module: megatron-core's local layers store [None].
    data = torch_record.dumps([None])
    objects = sorted({(f"{extra_state_module(it.key)}._extra_state", it.prefix, it.axes)
                      for it in items if extra_state_module(it.key)})
    with open(folder / "__extra_0.distcp", "wb") as f:
        for key, prefix, axes in objects:
            fqn = (f"{key}/shard_{'.'.join(map(str, prefix))}_{'.'.join(map(str, axes))}"
                   if prefix else f"{key}/shard_0_1")
            state[fqn] = d.BytesStorageMetadata.make()
            storage[d.MetadataIndex.make(fqn=fqn, index=None, offset=None)] = \
                d.StorageInfo.make(relative_path="__extra_0.distcp", offset=f.tell(),
                                   length=len(data))
            f.write(data)
    md = d.Metadata.make(state_dict_metadata=state, planner_data=None, storage_data=storage,
                         storage_meta=d.StorageMeta.make(checkpoint_id=None,
                                                         save_id=str(uuid.uuid4()),
                                                         load_id=None, modules=[]),
                         version=d.DCP_VERSION)
    (folder / ".metadata").write_bytes(d.dumps(md))
    with open(folder / "common.pt", "wb") as f:
        torch_record.save_bytes(f, common)  # torch.save's bytes, written without torch
    (folder / "metadata.json").write_text(json.dumps(BACKEND))
