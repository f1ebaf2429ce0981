"""HF <-> megatron-core mapping: split rules (written once) and the pure per-rank plan."""

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
    "EXPERTS", "QKV", "Column", "Coord", "GateUp", "MappingError", "Part", "Piece", "Replicated",
    "Row", "Rule", "Table", "TensorPlan", "coalesce", "padded_vocab_size", "plan_rank",
    "stage_layers", "vocab",
]
