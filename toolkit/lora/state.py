"""Adapters of a live model (any layout) as full HF-shaped tensors, and back.

``gather_full`` collects the slices every rank holds (one copy per model-parallel rank: data- and
context-parallel replicas send nothing) on one rank and assembles PEFT-named full tensors; what
it collects is asked per adapter parameter, so the same assembly serves the adapter weights,
their fp32 master copies and Adam's moments. ``FullTensors`` serves such tensors back to
``toolkit.lora.attach.fill`` at any layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from toolkit.lora.layers import A, B, LoraPair, M, branches
from toolkit.lora.peft_io import split_name, tensor_name
from toolkit.lora.plan import AdapterSlice

Local = Callable[[torch.nn.Parameter], torch.Tensor | None]


def pairs(chunks: Sequence[torch.nn.Module]) -> list[LoraPair]:
    return [p for _, _, b in branches(chunks) for p in b.pairs.values()]


def adapter_params(chunks: Sequence[torch.nn.Module]
                   ) -> list[tuple[str, torch.nn.Parameter, AdapterSlice, str]]:
    """(PEFT name, parameter, its slice, kind) of every adapter tensor this rank holds (names
    repeat across ranks: each holds a slice of the full tensor)."""
    return [(tensor_name(p.slice.module, kind), p.param(kind), p.slice, kind)
            for p in pairs(chunks) for kind in (A, B, M) if p.param(kind) is not None]


def gather_full(chunks: Sequence[torch.nn.Module], local: Local, *, replica: bool,
                dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Full PEFT-named float32 tensors on rank ``dst`` (None elsewhere). ``local(param)`` gives
    this rank's tensor of an adapter parameter (called on every rank, in the same order: it may
    be collective); ``replica``: this rank is a data/context-parallel copy and sends nothing."""
    mine = []
    for pair in pairs(chunks):
        for kind in (A, B, M):
            param = pair.param(kind)
            if param is None:
                continue
            value = local(param)
            if not replica and value is not None:
                mine.append((pair.slice, kind, value.detach().float().cpu()))
    everything: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, everything, dst=dst)
    if dist.get_rank() != dst:
        return None
    out: dict[str, torch.Tensor] = {}
    for part in everything:
        for s, kind, value in part:
            name = tensor_name(s.module, kind)
            if kind == A:
                full = out.setdefault(name, torch.zeros(value.shape[0], s.in_features))
                full[:, s.a_cols[0]:s.a_cols[1]] = value
                continue
            shape = (s.out_features,) + tuple(value.shape[1:])
            full = out.setdefault(name, torch.zeros(shape))
            for (a, b), (c, d) in s.b_rows:
                full[a:b] = value[c:d]
    return dict(sorted(out.items()))


class FullTensors:
    """PEFT-named full tensors served to ``attach.fill`` by HF module and kind."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.by_module: dict[tuple[str, str], torch.Tensor] = {}
        for name, value in tensors.items():
            parsed = split_name(name)
            if parsed is not None:
                self.by_module[parsed] = value

    def full(self, module: str, kind: str) -> torch.Tensor | None:
        return self.by_module.get((module, kind))

    def shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """``shapes[module][kind]`` (what ``targets.check_adapter`` checks)."""
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for (module, kind), value in self.by_module.items():
            out.setdefault(module, {})[kind] = tuple(value.shape)
        return out
