"""Split rules for fused tensors made of per-group blocks, and for stacked (3-D) stored tensors.

``Grouped``: a column-parallel tensor whose rows are, for each group (a key/value head group),
blocks of rows taken from one or more stored tensors at a stride. Tensor parallelism gives each
rank whole groups. Two megatron-side orders: ``group_major`` (each group's blocks together,
megatron-core's ``linear_qkv`` layout, also with Qwen3-Next's output gate: ``[q heads of g; gate
heads of g; k_g; v_g]``) or block-major (each block of every local group, then the next block).
Qwen3-Next's ``q_proj`` interleaves a query and a gate head by head, so a group's queries are
``count`` runs of ``rows`` rows ``step`` apart.

``Stacked``: one slice of stored tensors stacked along a leading dimension (Llama 4 stores its
experts as ``experts.gate_up_proj [experts, hidden, 2 * ffn]`` and ``experts.down_proj [experts,
ffn, hidden]``): a per-expert rule reading slice ``index``. The pieces keep the slice dimension
in ``src`` (``Piece.to_local`` drops it).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.mapping.rules import MappingError, Piece, Rule, Shape, _divide


@dataclass(frozen=True)
class Block:
    """Rows of stored tensor ``source`` that group ``g`` contributes: ``count`` runs of ``rows``
    rows, run ``c`` starting at ``base + g * stride + c * step``."""

    source: str
    base: int
    stride: int
    rows: int
    count: int = 1
    step: int = 0

    @property
    def size(self) -> int:
        return self.rows * self.count

    def runs(self, g: int) -> list[tuple[int, int]]:
        start = self.base + g * self.stride
        return [(start + c * self.step, start + c * self.step + self.rows)
                for c in range(self.count)]


@dataclass(frozen=True)
class Grouped(Rule):
    """A column-parallel tensor of ``groups`` groups of ``blocks`` (see the module docstring).

    ``inn``: the trailing dimensions (``(hidden,)`` for a linear weight, ``(1, kernel)`` for a
    depthwise convolution's weight, ``()`` for a vector)."""

    blocks: tuple[Block, ...]
    groups: int
    inn: tuple[int, ...] = ()
    group_major: bool = True

    def __post_init__(self) -> None:
        if not self.blocks or self.groups < 1:
            raise MappingError(f"a grouped rule needs blocks and groups ({self.blocks}).")

    @property
    def per_group(self) -> int:
        return sum(b.size for b in self.blocks)

    def hf_shapes(self) -> dict[str, Shape]:
        rows: dict[str, int] = {}
        for b in self.blocks:
            end = max(stop for _, stop in b.runs(self.groups - 1))
            rows[b.source] = max(rows.get(b.source, 0), end)
        return {name: (n, *self.inn) for name, n in rows.items()}

    def local_shape(self, size: int) -> Shape:
        local = _divide(self.groups, size, f"groups of {self.blocks[0].source}")
        return (local * self.per_group, *self.inn)

    def pieces(self, rank: int, size: int) -> tuple[Piece, ...]:
        local = _divide(self.groups, size, f"groups of {self.blocks[0].source}")
        groups = range(rank * local, (rank + 1) * local)
        order = ([(g, b) for g in groups for b in self.blocks] if self.group_major
                 else [(g, b) for b in self.blocks for g in groups])
        inner = tuple((0, n) for n in self.inn)
        out, at = [], 0
        for g, block in order:
            for lo, hi in block.runs(g):
                out.append(Piece(block.source, ((lo, hi), *inner),
                                 ((at, at + hi - lo), *inner)))
                at += hi - lo
        return tuple(out)


@dataclass(frozen=True)
class Stacked(Rule):
    """Slice ``index`` of stored tensors stacked ``count`` deep, read as ``rule`` reads a plain
    tensor (its shapes and pieces are those of one slice)."""

    rule: Rule
    index: int
    count: int

    @property
    def split(self) -> bool:  # type: ignore[override]
        return self.rule.split

    def hf_shapes(self) -> dict[str, Shape]:
        return {n: (self.count, *s) for n, s in self.rule.hf_shapes().items()}

    def local_shape(self, size: int) -> Shape:
        return self.rule.local_shape(size)

    def pieces(self, rank: int, size: int) -> tuple[Piece, ...]:
        at = (self.index, self.index + 1)
        return tuple(Piece(p.source, (at, *p.src), p.dst, p.transpose)
                     for p in self.rule.pieces(rank, size))
