"""HF <-> megatron-core mapping: split rules (written once) and the pure per-rank plan."""

from toolkit.mapping.grouped import Block, Grouped, Stacked
from toolkit.mapping.plan import (
    EXPERTS,
    Coord,
    Table,
    TensorPlan,
    coalesce,
    plan_rank,
    stage_layers,
)
from toolkit.mapping.rules import (
    QKV,
    Column,
    GateUp,
    MappingError,
    Part,
    Piece,
    Replicated,
    Row,
    Rule,
    padded_vocab_size,
    vocab,
)

__all__ = [
    "EXPERTS", "QKV", "Block", "Column", "Coord", "GateUp", "Grouped", "MappingError", "Part",
    "Piece", "Replicated", "Row", "Rule", "Stacked", "Table", "TensorPlan", "coalesce",
    "padded_vocab_size", "plan_rank", "stage_layers", "vocab",
]
