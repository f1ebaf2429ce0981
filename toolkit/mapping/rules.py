"""Split rules: how one megatron-core tensor is cut from (and put back into) Hugging Face tensors.

A rule describes one megatron-core parameter in its layout-independent form and answers, for the
shard ``rank`` of ``size`` (tensor-parallel or expert-tensor-parallel), which rectangular region
of which stored HF tensor fills which region of the local tensor (``pieces``). The same pieces
drive loading (read the source region, write the destination region) and export (read the
destination region of every shard, write the source region), so each rule is written once and
round trips are exact by construction.

Orientation: megatron-core linear weights are ``[out, in]``. HF ``nn.Linear`` stores the same;
GPT-2's ``Conv1D`` stores ``[in, out]`` (``transpose=True``). Offsets of a ``Part`` are counted
along the stored tensor's output dimension, which lets one stored tensor hold several parts
(GPT-2's ``c_attn`` holds q, k and v side by side).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserError

Range = tuple[int, int]  # [start, stop) along one dimension
Region = tuple[Range, ...]  # one range per dimension
Shape = tuple[int, ...]


class MappingError(UserError):
    """A mapping that cannot work for these sizes; the message names the tensor and the numbers."""


@dataclass(frozen=True)
class Piece:
    """Copy ``source[src]`` (transposed if ``transpose``) into ``local[dst]``.

    ``src`` may have more dimensions than ``dst``: its leading ones then select one slice of a
    stacked stored tensor (Llama 4's experts ``[experts, in, out]``), each of size 1."""

    source: str
    src: Region
    dst: Region
    transpose: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.src:
            n *= b - a
        return n

    @property
    def inner_src(self) -> Region:
        """``src`` without the leading slice dimensions (as many dimensions as ``dst``)."""
        return self.src[len(self.src) - len(self.dst):]

    def to_local(self, part):
        """The stored region ``part`` (a tensor of ``src``'s shape) as the local tensor's
        region: the slice dimensions dropped, transposed if the piece is. (Writing back,
        ``local[dst]`` transposed fits ``source[src]`` by broadcasting.)"""
        if len(self.src) > len(self.dst):
            part = part.reshape(part.shape[len(self.src) - len(self.dst):])
        return part.t() if self.transpose else part


@dataclass(frozen=True)
class Part:
    """A block of a stored HF tensor starting at ``offset`` along its output dimension."""

    source: str
    offset: int = 0


def _divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise MappingError(f"{what}={total} is not divisible by the split size {size}.")
    return total // size


def _src(out: Range, inn: Range | None, transpose: bool) -> Region:
    if inn is None:
        return (out,)
    return (inn, out) if transpose else (out, inn)


def _dst(out: Range, inn: Range | None) -> Region:
    return (out,) if inn is None else (out, inn)


def _stored(out: int, inn: int | None, transpose: bool) -> Shape:
    if inn is None:
        return (out,)
    return (inn, out) if transpose else (out, inn)


class Rule:
    """Base of the split rules. ``split`` says whether megatron-core shards the tensor."""

    split: bool = True

    def hf_shapes(self) -> dict[str, Shape]:
        """Full shape of every stored HF tensor this rule reads."""
        raise NotImplementedError

    def local_shape(self, size: int) -> Shape:
        """Shape of the megatron-core tensor on one of ``size`` shards."""
        raise NotImplementedError

    def pieces(self, rank: int, size: int) -> tuple[Piece, ...]:
        """The regions of HF tensors that make up shard ``rank`` of ``size``."""
        raise NotImplementedError

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(self.hf_shapes())


@dataclass(frozen=True)
class Replicated(Rule):
    """Same full tensor on every shard (norms, row-parallel biases, routers, position table)."""

    source: str
    shape: Shape
    split = False

    def hf_shapes(self) -> dict[str, Shape]:
        return {self.source: self.shape}

    def local_shape(self, size: int) -> Shape:
        return self.shape

    def pieces(self, rank: int, size: int) -> tuple[Piece, ...]:
        full = tuple((0, n) for n in self.shape)
        return (Piece(self.source, full, full),)


@dataclass(frozen=True)
class Column(Rule):
    """Split along the output dimension (column-parallel weight or bias; ``inn=None`` = bias).

    ``padded_out`` > ``out`` pads the tensor with zero rows at the end (vocab padding): shards
    cover ``padded_out`` rows, only the first ``out`` come from (and go back to) the HF tensor.
    """

    source: str
    out: int
    inn: int | None = None
    transpose: bool = False
    padded_out: int | None = None

    def hf_shapes(self) -> dict[str, Shape]:
        return {self.source: _stored(self.out, self.inn, self.transpose)}

    def local_shape(self, size: int) -> Shape:
        rows = _divide(self.padded_out or self.out, size, f"rows of {self.source}")
        return (rows,) if self.inn is None else (rows, self.inn)

    def pieces(self, rank: int, size: int) -> tuple[Piece, ...]:
        rows = self.local_shape(size)[0]
        lo, hi = rank * rows, min((rank + 1) * rows, self.out)
        if hi <= lo:  # a shard made only of padding
            return ()
        inn = None if self.inn is None else (0, self.inn)
        return (Piece(self.source, _src((lo, hi), inn, self.transpose),
                      _dst((0, hi - lo), inn), self.transpose and inn is not None),)


def vocab(source: str, vocab_size: int, padded: int, hidden: int) -> Column:
    """Vocab-parallel embedding or output layer: rows split over TP, zero padding at the end."""
    if padded < vocab_size:
        raise MappingError(f"padded vocab {padded} is smaller than vocab_size={vocab_size}.")
    return Column(source, vocab_size, hidden, padded_out=padded)


@dataclass(frozen=True)
class Row(Rule):
    """Split along the input dimension (row-parallel weight; its bias is ``Replicated``)."""

    source: str
    out: int
    inn: int
    transpose: bool = False

    def hf_shapes(self) -> dict[str, Shape]:
        return {self.source: _stored(self.out, self.inn, self.transpose)}

    def local_shape(self, size: int) -> Shape:
        return (self.out, _divide(self.inn, size, f"input features of {self.source}"))

    def pieces(self, rank: int, size: int) -> tuple[Piece, ...]:
        cols = self.local_shape(size)[1]
        inn = (rank * cols, (rank + 1) * cols)
        return (Piece(self.source, _src((0, self.out), inn, self.transpose),
                      ((0, self.out), (0, cols)), self.transpose),)


def _parts_shapes(parts: list[tuple[Part, int]], inn: int | None,
                  transpose: bool) -> dict[str, Shape]:
    extent: dict[str, int] = {}
    for part, rows in parts:
        extent[part.source] = max(extent.get(part.source, 0), part.offset + rows)
    return {name: _stored(rows, inn, transpose) for name, rows in extent.items()}


@dataclass(frozen=True)
class QKV(Rule):
    """Fused query/key/value in megatron-core's per-query-group layout.

    megatron-core's ``linear_qkv`` output rows are, for each query group g,
    ``[q heads of g (heads/groups * head_dim rows); k_g (head_dim); v_g (head_dim)]``.
    Tensor parallelism gives each rank whole groups, so each shard reads one contiguous block of
    q, of k and of v. MHA is groups == heads, MQA groups == 1 (then tp must be 1).
    ``inn=None`` describes the bias.
    """

    q: Part
    k: Part
    v: Part
    heads: int
    groups: int
    head_dim: int
    inn: int | None = None
    transpose: bool = False

    def __post_init__(self) -> None:
        if self.heads % self.groups:
            raise MappingError(
                f"num_attention_heads={self.heads} is not a multiple of num_key_value_heads="
                f"{self.groups} ({self.q.source})."
            )

    def _parts(self) -> list[tuple[Part, int]]:
        kv = self.groups * self.head_dim
        return [(self.q, self.heads * self.head_dim), (self.k, kv), (self.v, kv)]

    def hf_shapes(self) -> dict[str, Shape]:
        return _parts_shapes(self._parts(), self.inn, self.transpose)

    def local_shape(self, size: int) -> Shape:
        groups = _divide(self.groups, size, "query groups (num_key_value_heads)")
        rows = groups * (self.heads // self.groups + 2) * self.head_dim
        return (rows,) if self.inn is None else (rows, self.inn)

    def pieces(self, rank: int, size: int) -> tuple[Piece, ...]:
        local_groups = _divide(self.groups, size, "query groups (num_key_value_heads)")
        per_group = self.heads // self.groups
        q_rows, d = per_group * self.head_dim, self.head_dim
        inn = None if self.inn is None else (0, self.inn)
        t = self.transpose and inn is not None
        out: list[Piece] = []
        for j in range(local_groups):
            g = rank * local_groups + j
            base = j * (q_rows + 2 * d)
            blocks = [
                (self.q, self.q.offset + g * q_rows, q_rows, base),
                (self.k, self.k.offset + g * d, d, base + q_rows),
                (self.v, self.v.offset + g * d, d, base + q_rows + d),
            ]
            for part, start, rows, at in blocks:
                out.append(Piece(part.source, _src((start, start + rows), inn, self.transpose),
                                 _dst((at, at + rows), inn), t))
        return tuple(out)


@dataclass(frozen=True)
class GateUp(Rule):
    """SwiGLU ``linear_fc1``: each shard holds ``[gate shard; up shard]`` (megatron-core's order).

    Used for dense MLPs, shared experts and per-expert MLPs (with the expert-TP rank/size).
    """

    gate: Part
    up: Part
    ffn: int
    inn: int | None = None
    transpose: bool = False

    def hf_shapes(self) -> dict[str, Shape]:
        return _parts_shapes([(self.gate, self.ffn), (self.up, self.ffn)], self.inn,
                             self.transpose)

    def local_shape(self, size: int) -> Shape:
        rows = 2 * _divide(self.ffn, size, f"ffn size of {self.gate.source}")
        return (rows,) if self.inn is None else (rows, self.inn)

    def pieces(self, rank: int, size: int) -> tuple[Piece, ...]:
        f = _divide(self.ffn, size, f"ffn size of {self.gate.source}")
        inn = None if self.inn is None else (0, self.inn)
        t = self.transpose and inn is not None
        out = []
        for i, part in enumerate((self.gate, self.up)):
            start = part.offset + rank * f
            out.append(Piece(part.source, _src((start, start + f), inn, self.transpose),
                             _dst((i * f, (i + 1) * f), inn), t))
        return tuple(out)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Smallest size >= vocab_size divisible by ``multiple * tp`` (megatron-core needs tp | V)."""
    if multiple < 1:
        raise MappingError(f"vocab padding multiple={multiple} must be >= 1.")
    step = multiple * tp
    return -(-vocab_size // step) * step
