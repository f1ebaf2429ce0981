"""The converter's common currency: full megatron-core tensors seen as an HF checkpoint.

Every megatron-side reader (torch_dist, legacy ``mp_rank_XX``, DeepSpeed) reassembles the
tensors a tp=1 / pp=1 / ep=1 megatron-core ``GPTModel`` would hold, under their *global* names
(``decoder.layers.<global layer>.<suffix>``, ``...mlp.experts.local_experts.<global expert>...``:
the keys of ``Table.items()``), and hands them to ``McoreFullSource``. It inverts the adapter's
mapping table with the size-1 pieces of each rule (the same pieces the loader uses, so fused
QKV / gate-up are undone exactly as they are made) and exposes the HF reader interface every
writer consumes:

    McoreFullSource(adapter, hf_config, names_shapes, get)
      adapter:      toolkit.adapters.Adapter of the model (its tp=1 Table is used)
      hf_config:    the transformers config (kept as ``.hf_config`` for writers)
      names_shapes: {global megatron name: (full shape, dtype)} of what the checkpoint holds
      get:          name -> the full tensor (called lazily; the last few are cached)

    .names                -> list of HF tensor names (a property, as on HFReader)
    .shape(name), .dtype(name), .read(name, region), .close()

Vocab rows may be padded beyond ``vocab_size`` (a checkpoint written at tp>1): the padding is
ignored. Missing or unexpected megatron tensors raise ``CheckpointError`` naming them.

Also here, the two rule-level helpers the readers and writers share: ``local_tensor`` (one shard
of one rule, filled from any reader) and ``hf_from_shards`` (HF tensors of a rule from its shards).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.source import ModelAdapter, Region
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.lazy import torch
from toolkit.mapping import Column, Piece, Rule

Reader = Callable[[str, Region], "torch.Tensor"]
#: name, region -> ``(file, offset, length)`` of those whole rows as stored, or None.
Locator = Callable[[str, Region], "tuple[Any, int, int] | None"]


def _idx(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def local_tensor(rule: Rule, rank: int, size: int, read: Reader,
                 dtype: torch.dtype) -> torch.Tensor:
    """Shard ``rank`` of ``size`` of ``rule``, read piece by piece (vocab padding rows are zero)."""
    if not rule.split:
        rank, size = 0, 1
    pieces = rule.pieces(rank, size)
    shape = rule.local_shape(size)
    numel = 1
    for n in shape:
        numel *= n
    if len(pieces) == 1 and not pieces[0].transpose and pieces[0].numel == numel:
        part = read(pieces[0].source, pieces[0].src)  # the whole local tensor in one read
        if tuple(part.shape) == tuple(shape):
            return part if part.dtype == dtype else part.to(to_torch(dtype))
    dtype = to_torch(dtype)
    covered = sum(p.numel for p in pieces)
    out = torch.zeros(shape, dtype=dtype) if covered != numel else torch.empty(shape, dtype=dtype)
    for p in pieces:
        out[_idx(p.dst)] = p.to_local(read(p.source, p.src))
    return out


def local_segments(rule: Rule, rank: int, size: int, locate: Locator,
                   itemsize: int) -> list[tuple[Any, int, int]] | None:
    """Shard ``rank`` of ``size`` of ``rule`` as ``(file, offset, length)`` byte ranges in
    row-major order (file None: zero rows, the vocab padding), when every piece is whole rows of
    its source (``locate(name, region)``: the range of those rows as stored, or None) and whole
    rows of the shard (no transpose, no inner-dimension cut): then a writer copies the bytes
    file to file. None when any piece is not (then ``local_tensor`` assembles it in memory)."""
    if not rule.split:
        rank, size = 0, 1
    shape = rule.local_shape(size)
    if not shape:
        return None
    row = itemsize
    for n in shape[1:]:
        row *= n
    inner = tuple((0, n) for n in shape[1:])
    out: list[tuple[Any, int, int]] = []
    at = 0
    for p in sorted(rule.pieces(rank, size), key=lambda p: p.dst[0][0]):
        a, b = p.dst[0]
        if p.transpose or tuple(p.dst[1:]) != inner or a < at:
            return None
        where = locate(p.source, p.src)
        if where is None or where[2] != (b - a) * row:
            return None
        if a > at:
            out.append((None, 0, (a - at) * row))
        out.append(where)
        at = b
    if at < shape[0]:
        out.append((None, 0, (shape[0] - at) * row))
    return out


def hf_from_shards(rule: Rule, shards: dict[int, torch.Tensor]) -> dict[str, Any]:
    """The HF tensors of ``rule`` rebuilt from all its shards ``{rank: tensor}`` (padding
    dropped). Each is the region the rule covers (its whole tensor, or one slice of a stacked
    one: ``_Box``), indexed by the stored tensor's own coordinates."""
    size = len(shards) if rule.split else 1
    if rule.split and sorted(shards) != list(range(size)):
        raise CheckpointError(f"shards {sorted(shards)} of {rule.sources} are incomplete.")
    dtype = next(iter(shards.values())).dtype
    out = {n: _Box(region, dtype) for n, region in _covered(rule).items()}
    filled = dict.fromkeys(out, 0)
    for rank in range(size):
        local = shards[rank]
        want = rule.local_shape(size)
        if tuple(local.shape) != want:
            raise CheckpointError(f"shard {rank}/{size} of {rule.sources[0]}...: shape "
                                  f"{tuple(local.shape)}, the mapping expects {want}.")
        for p in rule.pieces(rank, size):
            part = local[_idx(p.dst)]
            out[p.source][_idx(p.src)] = part.t() if p.transpose else part
            filled[p.source] += p.numel
    for name, box in out.items():
        if filled[name] != box.tensor.numel():
            raise CheckpointError(f"{name}: shards filled {filled[name]} of "
                                  f"{box.tensor.numel()} elements.")
    return out


def _covered(rule: Rule) -> dict[str, Region]:
    """The bounding region of each stored tensor that ``rule`` reads (the whole tensor, but
    one slice of a stacked tensor for a per-expert rule)."""
    boxes: dict[str, Region] = {}
    for p in rule.pieces(0, 1):
        old = boxes.get(p.source)
        boxes[p.source] = p.src if old is None else tuple(
            (min(a0, b0), max(a1, b1)) for (a0, a1), (b0, b1) in zip(old, p.src, strict=True))
    return boxes


class _Box:
    """A region of a stored tensor, held on its own and indexed in the stored coordinates."""

    def __init__(self, region: Region, dtype: Any) -> None:
        self.origin = tuple(a for a, _ in region)
        self.tensor = torch.empty(tuple(b - a for a, b in region), dtype=dtype)

    def _shift(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        return tuple(slice(s.start - o, s.stop - o) for s, o in zip(index, self.origin,
                                                                     strict=True))

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[self._shift(index)]

    def __setitem__(self, index: tuple[slice, ...], value: torch.Tensor) -> None:
        self.tensor[self._shift(index)] = value


def _intersect(a: Region, b: Region) -> Region | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def _src_to_dst(piece: Piece, sub: Region) -> Region:
    """The local region holding the sub-region ``sub`` of the piece's HF source region."""
    src, sub = piece.inner_src, sub[len(piece.src) - len(piece.dst):]
    if piece.transpose:  # src is (in, out) of the stored tensor, dst is (out, in)
        src, sub = src[::-1], sub[::-1]
    return tuple((d0 + s0 - p0, d0 + s1 - p0)
                 for (s0, s1), (p0, _), (d0, _) in zip(sub, src, piece.dst, strict=True))


class McoreFullSource:
    """Full (tp=1, global-numbered) megatron-core tensors exposed under their HF names."""

    def __init__(self, adapter: ModelAdapter, hf_config: Any,
                 names_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 get: Callable[[str], torch.Tensor], *, cache: int = 2,
                 locate: Callable[[str], tuple[Any, int] | None] | None = None):
        self.adapter = adapter
        self._locate = locate
        self.hf_config = hf_config
        self._have = dict(names_shapes)
        self._get = get
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_size = cache
        table = adapter.table_at(adapter.dims.vocab)  # the full tensors, vocab unpadded
        self._rules = dict(table.items())
        # HF name -> [(megatron key, piece)], from the first present key(s) covering it (a tied
        # output layer names the embedding's HF tensor again: the first holder wins).
        self._by_hf: dict[str, list[tuple[str, Piece]]] = {}
        self._shapes = table.hf_shapes()
        covered: dict[str, int] = {}
        missing, bad = [], []
        for key, rule in self._rules.items():
            if key not in self._have:
                continue
            shape, _ = self._have[key]
            want = rule.local_shape(1)
            padded = isinstance(rule, Column) and rule.padded_out is not None
            if tuple(shape) != want and not (padded and len(shape) == len(want)
                                             and shape[0] >= want[0] and shape[1:] == want[1:]):
                bad.append(f"{key}: {tuple(shape)}, expected {want}")
                continue
            for piece in rule.pieces(0, 1):
                total = math.prod(self._shapes[piece.source])
                if covered.get(piece.source, 0) >= total:
                    continue  # already provided by an earlier key (tied weights)
                self._by_hf.setdefault(piece.source, []).append((key, piece))
                covered[piece.source] = covered.get(piece.source, 0) + piece.numel
        for name, shape in self._shapes.items():
            if covered.get(name, 0) < math.prod(shape):
                holders = [k for k, r in self._rules.items() if name in r.sources]
                missing.append(f"{name} (from {' or '.join(holders)})")
        used = set(self._rules)
        extra = [k for k in self._have if k not in used]
        problems = []
        if bad:
            problems.append("shapes differ from config.json: " + "; ".join(bad[:8]))
        if missing:
            problems.append(f"{len(missing)} tensor(s) missing: " + "; ".join(missing[:8]))
        if extra:
            problems.append(f"{len(extra)} tensor(s) the {adapter.architecture} mapping does not "
                            "use (refusing to drop weights): " + ", ".join(extra[:8]))
        if problems:
            raise CheckpointError("megatron-core tensors do not match the model: "
                                  + " | ".join(problems))

    def __enter__(self) -> McoreFullSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._cache.clear()

    @property
    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise CheckpointError(f"no tensor {name!r} in this checkpoint.")
        return tuple(self._shapes[name])

    def dtype(self, name: str) -> torch.dtype:
        key = self._by_hf[name][0][0]
        return self._have[key][1]

    def megatron_names(self, name: str) -> list[str]:
        """The megatron-core tensors an HF tensor is cut from (for progress / error messages)."""
        return sorted({k for k, _ in self._by_hf[name]})

    def _full(self, key: str) -> torch.Tensor:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        t = self._get(key)
        shape = self._have[key][0]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{key}: read shape {tuple(t.shape)}, metadata says "
                                  f"{tuple(shape)}.")
        self._cache[key] = t
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return t

    def segments(self, name: str) -> list[tuple[Any, int, int]] | None:
        """HF tensor ``name`` as ``(file, offset, length)`` byte ranges of the checkpoint files,
        in order, when it is made of whole rows of megatron tensors stored as plain blocks
        (``locate``: name -> (file, offset) of a stored tensor): then a writer can copy the
        bytes file to file without reading them. None when it is not (transposed pieces,
        pieces cutting inner dimensions, no ``locate``)."""
        shape = self.shape(name)
        if self._locate is None or not shape:
            return None
        itemsize = self.dtype(name).itemsize
        out, row = [], 0
        for key, piece in sorted(self._by_hf[name], key=lambda kp: kp[1].src[0][0]):
            full = self._have[key][0]
            if (piece.transpose or piece.src[0][0] != row
                    or self._have[key][1] != self.dtype(name)
                    or tuple(piece.src[1:]) != tuple((0, n) for n in shape[1:])
                    or tuple(piece.dst[1:]) != tuple((0, n) for n in full[1:])):
                return None
            where = self._locate(key)
            if where is None:
                return None
            file, start = where
            inner = math.prod(tuple(full[1:])) * itemsize
            (a, b) = piece.dst[0]
            out.append((file, start + a * inner, (b - a) * inner))
            row = piece.src[0][1]
        return out if row == shape[0] else None

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """Region ``[(start, stop), ...]`` (default: all) of HF tensor ``name``."""
        shape = self.shape(name)
        region = tuple(region) if region is not None else tuple((0, n) for n in shape)
        held = self._by_hf[name]
        if len(held) == 1 and not held[0][1].transpose and region == tuple(
                (0, n) for n in shape):
            key, piece = held[0]
            full = self._full(key)
            if tuple(piece.dst) == tuple((0, n) for n in full.shape) and tuple(
                    full.shape) == tuple(shape):
                return full
        out = torch.empty(tuple(b - a for a, b in region), dtype=to_torch(self.dtype(name)))
        filled = 0
        for key, piece in self._by_hf[name]:
            sub = _intersect(piece.src, region)
            if sub is None:
                continue
            part = self._full(key)[_idx(_src_to_dst(piece, sub))]
            out[tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(sub, region,
                                                                      strict=True))] = (
                part.t() if piece.transpose else part)
            filled += math.prod(tuple(b - a for a, b in sub))
        if filled != out.numel():
            raise CheckpointError(f"{name}{list(region)}: only {filled} of {out.numel()} "
                                  "elements are held by megatron-core tensors (mapping gap).")
        return out


