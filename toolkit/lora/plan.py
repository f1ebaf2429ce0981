"""Which slice of which LoRA tensor each rank holds: the mapping's pieces, read for adapters.

A LoRA adapter of an HF projection ``P`` (``q_proj``, ``gate_up_proj``, GPT-2's ``c_attn``, ...) is
``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]`` (and DoRA's ``lora_magnitude_vector`` ``[out]``) in
HF's ``[out, in]`` orientation. megatron-core holds ``P`` inside a fused, split linear layer; the
split rule of that layer (``toolkit.mapping``) already says, per rank, which output rows and input
columns of ``P`` the rank holds and where they sit in the local weight. The adapter follows it:

- column-parallel (QKV, gate/up, plain column, MLA projections): ``lora_A`` whole on every rank,
  ``lora_B`` (and the magnitude) the rows of ``P`` the rank holds, in the rank's order, and an index
  that puts each of them at its row of the fused local output (GQA-interleaved q/k/v, [gate; up]).
- row-parallel (``o_proj``, ``down_proj``, GPT-2's ``c_proj``): ``lora_A`` the rank's input columns,
  ``lora_B`` and the magnitude whole.

Pure functions of the mapping ``Table`` and a ``Coord`` (no torch, no process groups): attaching
adapters, exporting them and resuming them at another layout read the same slices.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from toolkit.mapping import EXPERTS, QKV, Column, Coord, GateUp, Row, Rule, Table, plan_rank
from toolkit.mapping.rules import Range

COLUMN, ROW = "column", "row"
SPLIT_RULES = (QKV, GateUp, Column)


@dataclass(frozen=True)
class AdapterSlice:
    """One HF projection's adapter as one rank holds it."""

    chunk: int
    linear: str  # megatron-core module of the chunk (local layer numbering)
    key: str  # the same, global numbering (layout-independent)
    module: str  # HF module name, e.g. model.layers.3.self_attn.q_proj
    kind: str  # COLUMN or ROW
    in_features: int
    out_features: int
    a_cols: Range  # columns of the full lora_A held here
    b_rows: tuple[tuple[Range, Range], ...]  # (rows of the full lora_B, rows of the local one)
    out_rows: tuple[tuple[Range, Range], ...]  # (rows of the linear's local output, local B rows)

    @property
    def target(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    @property
    def local_out(self) -> int:
        return sum(b - a for (a, b), _ in self.b_rows)

    @property
    def local_in(self) -> int:
        return self.a_cols[1] - self.a_cols[0]

    @property
    def layer(self) -> int:
        return int(self.key.split(".")[2])


def linear_rules(table: Table) -> Iterator[tuple[str, Rule]]:
    """(global weight key, rule) of every linear weight of the decoder layers that LoRA can
    adapt: split column / row weights, no experts (routed experts: see ``spec``), no biases."""
    for key, rule in table.items():
        if not key.startswith("decoder.layers.") or not key.endswith(".weight"):
            continue
        if f".{EXPERTS}." in key or getattr(rule, "inn", None) is None:
            continue
        if isinstance(rule, (*SPLIT_RULES, Row)):
            yield key, rule


def hf_module(source: str) -> str:
    """The HF module of a stored weight name (``...q_proj.weight`` -> ``...q_proj``)."""
    return source.removesuffix(".weight")


def target_of(source: str) -> str:
    return hf_module(source).rsplit(".", 1)[-1]


def _out_in(piece_src: tuple[Range, ...], transpose: bool) -> tuple[Range, Range]:
    return (piece_src[1], piece_src[0]) if transpose else (piece_src[0], piece_src[1])


def plan_adapters(table: Table, coord: Coord, targets: frozenset[str]) -> list[AdapterSlice]:
    """The adapters of every targeted projection held by the rank at ``coord``, by chunk."""
    rules = dict(linear_rules(table))
    out: list[AdapterSlice] = []
    for t in plan_rank(table, coord):
        rule = rules.get(t.key)
        if rule is None:
            continue
        shapes = rule.hf_shapes()
        by_source: dict[str, list] = {}
        for piece in t.pieces:
            if target_of(piece.source) in targets:
                by_source.setdefault(piece.source, []).append(piece)
        for source, pieces in by_source.items():
            transpose = getattr(rule, "transpose", False)
            stored = shapes[source]
            n_out, n_in = (stored[1], stored[0]) if transpose else stored
            kind = ROW if isinstance(rule, Row) else COLUMN
            b_rows, out_rows, at = [], [], 0
            a_cols = (0, n_in)
            for piece in pieces:
                rows, cols = _out_in(piece.src, transpose)
                if kind == ROW:
                    a_cols, rows = cols, (0, n_out)
                n = rows[1] - rows[0]
                b_rows.append((rows, (at, at + n)))
                out_rows.append((piece.dst[0], (at, at + n)))
                at += n
            out.append(AdapterSlice(t.chunk, t.name.removesuffix(".weight"),
                                    t.key.removesuffix(".weight"), hf_module(source), kind,
                                    n_in, n_out, a_cols, tuple(b_rows), tuple(out_rows)))
    return out
