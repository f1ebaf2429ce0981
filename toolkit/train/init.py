"""Layout-invariant random initialization for pretraining from a config.

megatron-core initializes each rank's shard from the global RNG state of that rank, so the same
seed gives other weights at pp=2 than at pp=1 (and tp, vpp, ep change them again). Here every
*full* HF-named tensor is drawn on CPU from its own generator, seeded by (seed, tensor name),
with the init megatron-core would use for the parameter it fills (``config.init_method``,
``output_layer_init_method`` for ``linear_proj`` / ``linear_fc2``, ``embedding_init_method``,
norms ones, biases zero), and then sliced for this rank through the adapter's mapping (the same
plans that load an HF checkpoint). Any layout therefore starts from bit-identical weights; cp and
dp ranks replicate them. Costs one full tensor at a time per rank (drawn, sliced, dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from toolkit.mapping import MappingError
from toolkit.mapping.rules import Region
from toolkit.models.seeding import tensor_seed

if TYPE_CHECKING:
    from toolkit.adapters import Adapter

Init = Callable[[torch.Tensor], Any]


def init_kind(key: str, ndim: int) -> str:
    """How megatron-core initializes the parameter with global name ``key``."""
    leaf = key.rsplit(".", 1)[-1]
    owner = key.rsplit(".", 2)[-2] if key.count(".") >= 1 else ""
    if "norm" in owner or "norm" in leaf:
        return "zeros" if leaf == "bias" or leaf.endswith("_bias") else "ones"
    if leaf == "bias" or leaf.endswith("_bias"):
        return "zeros"
    if ndim >= 2 and key.startswith("embedding."):
        return "embedding"
    if ndim >= 2 and owner in ("linear_proj", "linear_fc2"):
        return "output"
    if ndim >= 2:
        return "normal"
    raise MappingError(f"{key}: no initialization known for a {ndim}-d parameter; pretraining "
                       "from a config needs one (start from an HF checkpoint with model.path).")


class InitSource:
    """HF-named full tensors of a fresh model, drawn on demand (the HF reader interface that
    ``toolkit.adapters.live.fill_chunks`` reads; the last tensor drawn is cached)."""

    def __init__(self, adapter: Adapter, config: Any, seed: int):
        self.seed = seed
        self._shapes = dict(adapter.table(1).hf_shapes())
        self._inits: dict[str, Init] = {}
        methods: dict[str, Init] = {
            "normal": config.init_method,
            "output": config.output_layer_init_method,
            "embedding": config.embedding_init_method or config.init_method,
            "ones": torch.nn.init.ones_,
            "zeros": torch.nn.init.zeros_,
        }
        for key, rule in adapter.table(1).items():
            for name, shape in rule.hf_shapes().items():
                self._inits.setdefault(name, methods[init_kind(key, len(shape))])
        self._cached: tuple[str, torch.Tensor] | None = None

    @property
    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shapes[name])

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (float32), the same on every rank and layout."""
        if self._cached is None or self._cached[0] != name:
            out = torch.empty(self._shapes[name], dtype=torch.float32)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(tensor_seed(self.seed, name))
                self._inits[name](out)
            self._cached = (name, out)
        return self._cached[1]

    def read(self, name: str, region: Region) -> torch.Tensor:
        return self.full(name)[tuple(slice(a, b) for a, b in region)]


def initialize(chunks: list[Any], adapter: Adapter, seed: int) -> None:
    """Fill this rank's chunks with its slices of the layout-invariant initial weights."""
    from toolkit.adapters.live import fill_chunks

    source = InitSource(adapter, chunks[0].config, seed)
    fill_chunks(chunks, adapter, source, names={n: n for n in source.names})  # type: ignore[arg-type]
