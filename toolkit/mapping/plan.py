"""The mapping engine: which slice of which HF tensor fills which megatron-core tensor on a rank.

Pure functions of a ``Table`` (the model's rules, layout-independent, from an adapter) and a
``Coord`` (one rank's position in the layout). No torch.distributed and no files: the same plan
drives a rank loading its shard, export gathering shards, and an offline converter.

Parameter names in a plan are those of megatron-core's ``GPTModel`` chunks: ``name`` uses the
chunk's local layer / expert numbering (what ``chunk.named_parameters()`` yields), ``key`` the
global numbering (layout-independent, the same on every layout).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from toolkit.mapping.rules import MappingError, Piece, Region, Rule, Shape

EXPERTS = "mlp.experts.local_experts"


@dataclass(frozen=True)
class Coord:
    """One rank's position: tensor, pipeline (with virtual stages), expert and expert-TP ranks."""

    tp_rank: int = 0
    tp: int = 1
    pp_rank: int = 0
    pp: int = 1
    vpp: int = 1
    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1


@dataclass(frozen=True)
class Table:
    """A model's rules by megatron-core name, as an adapter declares them.

    ``embedding``: names on the first stage (``embedding.word_embeddings.weight``, ...).
    ``head``: names on the last stage (``decoder.final_layernorm.weight``, ``output_layer.weight``).
    ``layers[i]``: suffixes after ``decoder.layers.<i>.`` for global layer i.
    ``experts[i][e]``: suffixes after ``decoder.layers.<i>.mlp.experts.local_experts.<e>.`` for
    global expert e of layer i (split by expert-TP; experts are spread over EP ranks).
    ``tied``: the output layer shares the embedding (no ``output_layer.weight`` on a chunk that
    also holds the embedding).
    """

    embedding: Mapping[str, Rule]
    head: Mapping[str, Rule]
    layers: Sequence[Mapping[str, Rule]]
    experts: Sequence[Sequence[Mapping[str, Rule]]] = field(default_factory=tuple)
    tied: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def items(self) -> Iterator[tuple[str, Rule]]:
        """Every global tensor (key, rule), in HF checkpoint order: embedding, layers, head."""
        yield from self.embedding.items()
        for i, rules in enumerate(self.layers):
            for suffix, rule in rules.items():
                yield f"decoder.layers.{i}.{suffix}", rule
            if i < len(self.experts):
                for e, erules in enumerate(self.experts[i]):
                    for suffix, rule in erules.items():
                        yield f"decoder.layers.{i}.{EXPERTS}.{e}.{suffix}", rule
        yield from self.head.items()

    def hf_shapes(self) -> dict[str, Shape]:
        """Every stored HF tensor the mapping expects, with its full shape."""
        shapes: dict[str, Shape] = {}
        for key, rule in self.items():
            for name, shape in rule.hf_shapes().items():
                if shapes.setdefault(name, shape) != shape:
                    raise MappingError(f"{key}: {name} has shape {shape} here and "
                                       f"{shapes[name]} in another rule.")
        return shapes


@dataclass(frozen=True)
class TensorPlan:
    """How one local megatron-core tensor of a rank is made of HF tensor regions."""

    chunk: int
    name: str
    key: str
    shard: int
    shards: int
    shape: Shape
    pieces: tuple[Piece, ...]


def stage_layers(num_layers: int, coord: Coord, chunk: int) -> range:
    """Global layers of ``chunk`` on this pipeline rank (megatron-core's even interleaved split)."""
    stages = coord.pp * coord.vpp
    if num_layers % stages:
        raise MappingError(f"num_layers={num_layers} is not divisible by pp*vpp={stages}.")
    n = num_layers // stages
    start = (chunk * coord.pp + coord.pp_rank) * n
    return range(start, start + n)


def plan_rank(table: Table, coord: Coord) -> list[TensorPlan]:
    """Every tensor of every chunk of the rank at ``coord``, with the HF regions it holds."""
    plans: list[TensorPlan] = []
    first_rank, last_rank = coord.pp_rank == 0, coord.pp_rank == coord.pp - 1
    for chunk in range(coord.vpp):
        pre = first_rank and chunk == 0
        post = last_rank and chunk == coord.vpp - 1

        def add(name: str, key: str, rule: Rule, rank: int, size: int, chunk: int = chunk) -> None:
            if not rule.split:
                rank, size = 0, 1
            plans.append(TensorPlan(chunk, name, key, rank, size, rule.local_shape(size),
                                    rule.pieces(rank, size)))

        if pre:
            for name, rule in table.embedding.items():
                add(name, name, rule, coord.tp_rank, coord.tp)
        layers = stage_layers(table.num_layers, coord, chunk)
        for local, layer in enumerate(layers):
            for suffix, rule in table.layers[layer].items():
                add(f"decoder.layers.{local}.{suffix}", f"decoder.layers.{layer}.{suffix}", rule,
                    coord.tp_rank, coord.tp)
            experts = table.experts[layer] if layer < len(table.experts) else ()
            if not experts:
                continue
            if len(experts) % coord.ep:
                raise MappingError(f"layer {layer}: {len(experts)} experts are not divisible by "
                                   f"ep={coord.ep}.")
            n_local = len(experts) // coord.ep
            for e in range(n_local):
                g = coord.ep_rank * n_local + e
                for suffix, rule in experts[g].items():
                    add(f"decoder.layers.{local}.{EXPERTS}.{e}.{suffix}",
                        f"decoder.layers.{layer}.{EXPERTS}.{g}.{suffix}", rule,
                        coord.etp_rank, coord.etp)
        if post:
            for name, rule in table.head.items():
                if name == "output_layer.weight" and table.tied and pre:
                    continue  # megatron-core reuses the embedding weight on this chunk
                add(name, name, rule, coord.tp_rank, coord.tp)
    return plans


def coalesce(regions: Sequence[Region]) -> list[tuple[Region, list[int]]]:
    """Group regions of one tensor into few reads: adjacent regions merge into one bounding box.

    Returns (box, indices of the regions inside it). Only exactly adjacent regions merge, so a
    read never covers data the rank does not need.
    """
    order = sorted(range(len(regions)), key=lambda i: regions[i])
    groups: list[tuple[Region, list[int]]] = []
    for i in order:
        region = regions[i]
        if groups:
            box, members = groups[-1]
            merged = _merge(box, region)
            if merged is not None:
                groups[-1] = (merged, [*members, i])
                continue
        groups.append((region, [i]))
    return groups


def _merge(a: Region, b: Region) -> Region | None:
    if a == b:
        return a
    diff = [d for d in range(len(a)) if a[d] != b[d]]
    if len(diff) != 1:
        return None
    d = diff[0]
    if a[d][1] == b[d][0]:
        return tuple((a[d][0], b[d][1]) if k == d else a[k] for k in range(len(a)))
    if b[d][1] == a[d][0]:
        return tuple((b[d][0], a[d][1]) if k == d else a[k] for k in range(len(a)))
    return None
