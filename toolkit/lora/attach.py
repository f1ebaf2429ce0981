"""Put adapters on a rank's model chunks and fill them from full HF-shaped tensors.

The full tensors come from a seeded draw (``SeededAdapters``: the same adapters at every layout,
each ``lora_A`` drawn over its whole HF shape and then sliced, unlike per-shard initialisation
whose scale changes with tp) or from an HF PEFT folder (``toolkit.lora.peft_io``); either way each
rank keeps the slices ``toolkit.lora.plan`` gives it. Everything but the adapters is frozen.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from toolkit.lora.layers import A, B, LoraBranch, M, branches, linear_kind, lora_class
from toolkit.lora.plan import AdapterSlice, plan_adapters
from toolkit.lora.spec import LoraError, LoraSpec
from toolkit.models.seeding import tensor_seed


class FullSource(Protocol):
    """Full HF-shaped adapter tensors by HF module and kind (``lora_A`` / ``lora_B`` / magnitude);
    None for a magnitude the source does not have (then it is computed from the weights)."""

    def full(self, module: str, kind: str) -> torch.Tensor | None: ...


class SeededAdapters:
    """PEFT's initialisation, drawn per HF module from (seed, module): ``lora_A`` Kaiming-uniform
    over its full ``[r, in]`` shape, ``lora_B`` zeros, DoRA's magnitude from the weights."""

    def __init__(self, seed: int, r: int, shapes: dict[str, tuple[int, int]]):
        self.seed, self.r, self.shapes = seed, r, shapes  # module -> (out, in)

    def full(self, module: str, kind: str) -> torch.Tensor | None:
        out_f, in_f = self.shapes[module]
        if kind == B:
            return torch.zeros(out_f, self.r)
        if kind == M:
            return None
        a = torch.empty(self.r, in_f)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tensor_seed(self.seed, f"{module}.lora_A"))
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        return a


def local_part(s: AdapterSlice, kind: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full adapter tensor."""
    if kind == A:
        return full[:, s.a_cols[0]:s.a_cols[1]]
    return torch.cat([full[a:b] for (a, b), _ in s.b_rows], 0)


def attach(chunks: Sequence[torch.nn.Module], adapter: Any, spec: LoraSpec, coord: Any,
           source: FullSource, *, tp_group: Any = None) -> list[LoraBranch]:
    """Adapters on every targeted layer of ``chunks`` (the rank at ``coord``), filled from
    ``source``; every other parameter frozen. Returns the branches."""
    slices = plan_adapters(adapter.table(coord.tp), coord, spec.targets)
    by_layer: dict[tuple[int, str], list[AdapterSlice]] = defaultdict(list)
    for s in slices:
        by_layer[(s.chunk, s.linear)].append(s)
    for p in (p for c in chunks for p in c.parameters()):
        p.requires_grad_(False)
    made = []
    for (chunk, name), group in by_layer.items():
        module = chunks[chunk].get_submodule(name)
        if linear_kind(module) != group[0].kind:
            raise LoraError(f"{name}: megatron-core built {type(module).__name__}, the mapping "
                            f"expects a {group[0].kind}-parallel layer.")
        weight = module.weight
        sp = bool(getattr(module, "sequence_parallel", False))
        branch = LoraBranch(group, weight.shape[0], r=spec.r, alpha=spec.alpha,
                            dropout=spec.dropout, dora=spec.dora, rslora=spec.rslora,
                            dtype=weight.dtype, device=weight.device,
                            tp_group=tp_group if coord.tp > 1 else None,
                            sequence_parallel=sp)
        module.add_module("lora", branch)
        module.__class__ = lora_class(type(module))
        fill(branch, source, weight)
        made.append(branch)
    return made


@torch.no_grad()
def fill(branch: LoraBranch, source: FullSource, weight: torch.Tensor) -> None:
    """Copy this rank's slices of ``source``'s tensors into ``branch``."""
    missing_m = False
    for pair in branch.pairs.values():
        s = pair.slice
        for kind in (A, B, M):
            param = pair.param(kind)
            if param is None:
                continue
            full = source.full(s.module, kind)
            if full is None:
                missing_m = True
                continue
            param.copy_(local_part(s, kind, full).to(param.dtype))
    if missing_m:
        branch.reset_magnitude(weight)


def trainable(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return [p for _, _, b in branches(chunks) for p in b.parameters()]


def folder_source(folder: str | Path, adapter: Any, spec: LoraSpec) -> Any:
    """The adapter tensors of an HF PEFT folder, checked against this model (the base it names,
    the targets and their shapes): a source for ``attach``. LoraError naming what differs."""
    from safetensors.torch import load_file

    from toolkit.lora.peft_io import WEIGHTS, check_base, read_config
    from toolkit.lora.state import FullTensors
    from toolkit.lora.targets import check_adapter

    _, raw = read_config(folder)
    check_base(raw, adapter.dims, str(folder))
    source = FullTensors(load_file(str(Path(folder) / WEIGHTS)))
    check_adapter(adapter, spec, source.shapes(), where=str(folder))
    return source
