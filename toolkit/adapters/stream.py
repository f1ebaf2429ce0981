"""The live model's weights streamed out as HF-named tensors, in buckets, from any layout.

Online RL puts the trainer's current weights into a rollout engine (vLLM's
``model.load_weights(iterable of (name, tensor))`` and others) after every few steps, without
writing a folder. ``hf_tensors`` assembles each HF tensor from its owners' megatron-core shards
(any tp / pp / vpp / ep / etp layout; one point-to-point send per shard to ``dst``, or one
broadcast per shard with ``dst=None``), strips the vocab padding, stacks members into their
stored tensors (GPT-OSS's fused experts) and ends with the source folder's tensors no model
holds (DeepSeek-V3's MTP layers): exactly the tensors, names, dtypes and order of the HF folder
``live.export_hf`` writes, because ``export_hf`` is this stream written by ``HFWriter``.
``hf_buckets`` groups it into lists of at most ``bucket_bytes``.

Both are collective: every rank iterates them in step (the ranks that hold no data get the
same number of items / buckets, with no tensors), so a consumer may run collectives between
buckets. Memory on a rank that materialises: one HF tensor group being assembled (the
tensors one mapping rule fills, or a stack being filled) plus what the consumer keeps (one
bucket).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from toolkit.adapters.adapter import Adapter
from toolkit.adapters.local import chunk_params, current_coord
from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.hf import HFReader
from toolkit.checkpoint.stacked import Stacker
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.errors import UserError
from toolkit.mapping import EXPERTS, Coord, MappingError, TensorPlan

#: Default bucket size: large enough that per-bucket overheads vanish, small next to a model.
DEFAULT_BUCKET_BYTES = 512 * 2**20

Bucket = list[tuple[str, torch.Tensor]]


class StreamError(UserError):
    """A weight stream asked for with settings that cannot work (bucket size, destination)."""


class Streamed(NamedTuple):
    """One HF tensor of the stream: its name, its size in bytes (known on every rank) and the
    tensor itself on the ranks that materialise the stream (None elsewhere)."""

    name: str
    nbytes: int
    tensor: torch.Tensor | None


def hf_buckets(chunks: list[Any], adapter: Adapter, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               dtype: torch.dtype | None = None, dst: int | None = 0) -> Iterator[Bucket]:
    """The live model as lists of ``(hf_name, tensor)`` of at most ``bucket_bytes`` each (a
    tensor larger than that comes alone), in the HF export's order and names.

    ``dst``: the rank the buckets materialise on (the others get empty lists, as many); None:
    every rank (a colocated engine on each). ``dtype``: the tensors' dtype (default: the HF
    checkpoint's). Collective: every rank iterates it in step. Tensors are on the CPU.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise StreamError(f"bucket_bytes={bucket_bytes!r}: give the largest bucket as a "
                          "positive number of bytes (e.g. 512 * 2**20).")
    return _bucketed(hf_tensors(chunks, adapter, dtype=dtype, dst=dst), bucket_bytes)


def hf_tensors(chunks: list[Any], adapter: Adapter, *, dtype: torch.dtype | None = None,
               dst: int | None = 0) -> Iterator[Streamed]:
    """Every HF tensor of the live model once, in the export's order (``hf_buckets`` without
    the buckets): tensors on ``dst`` (every rank when None), sizes everywhere. Collective."""
    world = dist.get_world_size()
    if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int)
                            or not 0 <= dst < world):
        raise StreamError(f"dst={dst!r} is not a rank of this world of {world}: give a rank "
                          "(the tensors materialise there) or None (on every rank).")
    return _stream(chunks, adapter, to_torch(dtype or adapter.hf_dtype), dst)


def _bucketed(items: Iterable[Streamed], limit: int) -> Iterator[Bucket]:
    """``items`` cut into buckets of at most ``limit`` bytes; the cuts depend on sizes only, so
    every rank cuts at the same places."""
    bucket: Bucket = []
    size = count = 0
    for item in items:
        if count and size + item.nbytes > limit:
            yield bucket
            bucket, size, count = [], 0, 0
        size += item.nbytes
        count += 1
        if item.tensor is not None:
            bucket.append((item.name, item.tensor))
    if count:
        yield bucket


def _stream(chunks: list[Any], adapter: Adapter, dtype: torch.dtype, dst: int | None
            ) -> Iterator[Streamed]:
    """The mapping's HF tensors in table order, each as soon as its rules have all been
    gathered (several rules fill one stacked tensor: Llama 4's experts), then the kept ones."""
    coords, owners = _owners(adapter)
    table = adapter.table(coords[0].tp)
    params = chunk_params(chunks)
    here = dst is None or dist.get_rank() == dst
    stacker = Stacker(adapter.stacks)  # GPT-OSS's experts: members into their stored tensors
    stored_shape = {s.stored: s.shape for s in adapter.stacks}
    done: set[str] = set()
    # HF tensors being assembled, with the elements the rules cover so far (the same count on
    # every rank) and, where they materialise, the elements written
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = defaultdict(int)
    covered: dict[str, int] = defaultdict(int)
    for key, rule in table.items():
        shapes = rule.hf_shapes()
        if set(shapes) <= done:
            continue  # tied output layer: its tensor is the embedding, already streamed
        _gather(key, rule, owners.get(key, {}), coords[0], params, dtype, dst,
                out if here else None, filled)
        for piece in rule.pieces(0, 1):
            covered[piece.source] += piece.numel
        for name, shape in shapes.items():
            if covered[name] < math.prod(shape):
                continue
            done.add(name)
            tensor = None
            if here:
                if filled[name] != math.prod(shape):
                    raise MappingError(f"{name}: export filled {filled[name]} of "
                                       f"{math.prod(shape)} elements (mapping gap).")
                tensor = out.pop(name)
            for n, t in stacker.add(name, tensor):
                yield Streamed(n, math.prod(stored_shape.get(n, shape)) * dtype.itemsize, t)
    if gap := [n for n, c in covered.items() if n not in done]:
        raise MappingError(f"{gap[0]}: the mapping covers {covered[gap[0]]} of its "
                           "elements (mapping gap).")
    if (problem := stacker.unfinished()) is not None:
        raise CheckpointError(problem)
    yield from _kept(adapter, dtype, dst, here)


def _owners(adapter: Adapter
            ) -> tuple[list[Coord], dict[str, dict[int, tuple[int, TensorPlan]]]]:
    """Every rank's coordinate, and for each HF key the rank (and plan) holding each shard."""
    coords: list[Coord] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(coords, current_coord())
    plans_of: dict[Coord, list[TensorPlan]] = {}
    owners: dict[str, dict[int, tuple[int, TensorPlan]]] = defaultdict(dict)
    for r, c in enumerate(coords):
        if c not in plans_of:
            plans_of[c] = adapter.plan(c)
        for t in plans_of[c]:
            owners[t.key].setdefault(t.shard, (r, t))
    return coords, owners


def _gather(key: str, rule: Any, shards: dict[int, tuple[int, TensorPlan]], coord: Coord,
            params: dict[tuple[int, str], torch.Tensor], dtype: torch.dtype, dst: int | None,
            out: dict[str, torch.Tensor] | None, filled: dict[str, int]) -> None:
    """The HF tensors of one table entry assembled (into ``out``, made there when missing;
    ``filled`` counts the elements written) from their owners' shards: one point-to-point
    send each to ``dst``, or one broadcast each when ``dst`` is None; ``out`` is None on the
    ranks that do not materialise."""
    rank = dist.get_rank()
    split = coord.etp if f".{EXPERTS}." in key else coord.tp
    if len(shards) != (split if rule.split else 1):
        raise MappingError(f"{key}: no rank holds all of its shards ({sorted(shards)}).")
    if out is not None:
        for n, s in rule.hf_shapes().items():
            if n not in out:
                out[n] = torch.empty(s, dtype=dtype)
    for shard in sorted(shards):
        owner, t = shards[shard]
        local = params[(t.chunk, t.name)].detach().contiguous() if rank == owner else None
        if dst is None:
            if local is None:
                local = _buffer(t, params)
            dist.broadcast(local, owner)
        elif rank == owner and rank != dst:
            dist.send(local, dst)
        elif rank == dst and rank != owner:
            local = _buffer(t, params)
            dist.recv(local, owner)
        if out is None:
            continue
        for piece in t.pieces:
            part = local[tuple(slice(a, b) for a, b in piece.dst)]
            if piece.transpose:
                part = part.t()
            out[piece.source][tuple(slice(a, b) for a, b in piece.src)] = part
            filled[piece.source] += piece.numel


def _buffer(t: TensorPlan, params: dict[tuple[int, str], torch.Tensor]) -> torch.Tensor:
    """Room for a shard received from its owner: the parameters' dtype, on their device."""
    like = next(iter(params.values()))
    return torch.empty(t.shape, dtype=like.dtype, device=like.device)


def _kept(adapter: Adapter, dtype: torch.dtype, dst: int | None, here: bool
          ) -> Iterator[Streamed]:
    """``kept_tensors`` on the ranks that materialise; with a ``dst`` the others get their
    names and sizes from it (one broadcast), so they stay in step without reading the folder."""
    if dst is None:
        yield from kept_tensors(adapter, dtype)
        return
    listing: list[Any] = [[(k.name, k.nbytes) for k in kept_tensors(adapter, dtype, read=False)]
                          if here else None]
    dist.broadcast_object_list(listing, src=dst)
    if here:
        yield from kept_tensors(adapter, dtype)
    else:
        yield from (Streamed(name, nbytes, None) for name, nbytes in listing[0])


def kept_tensors(adapter: Adapter, dtype: torch.dtype, *, read: bool = True
                 ) -> Iterator[Streamed]:
    """The tensors of the adapter's source HF folder that no model holds (``Adapter.kept``:
    DeepSeek-V3's MTP layers), one at a time (floating ones in ``dtype``), so an export writes
    them back unchanged; ``read=False``: names and sizes only."""
    src = adapter.source
    if src is None or not (any(src.glob("*.safetensors")) or any(src.glob("*.bin"))):
        return
    with HFReader(src) as reader:
        for name in adapter.kept(reader.names):
            shape = tuple(reader.shape(name))
            stored = reader.dtype(name)
            nbytes = math.prod(shape) * (dtype if stored.is_floating_point else stored).itemsize
            tensor = None
            if read:
                tensor = reader.read(name, tuple((0, n) for n in shape))
                tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
            yield Streamed(name, nbytes, tensor)
