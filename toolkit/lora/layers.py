"""LoRA / DoRA branches inside megatron-core's own parallel linear layers.

``attach`` gives every targeted ``ColumnParallelLinear`` / ``RowParallelLinear`` of a rank's
chunks a ``lora`` child (one ``LoraPair`` per HF projection it fuses, sliced as
``toolkit.lora.plan`` says) and swaps the layer's class for a subclass whose ``_forward_impl``
(the local matmul, before megatron-core's own output communication) adds the branch:

- column-parallel: ``h = A x``; with sequence parallelism ``x`` is this rank's sequence shard and
  ``h`` (r wide) is all-gathered (reduce-scattered in backward: ``A``'s gradient then covers this
  rank's tokens only and is summed over TP); without it ``h`` passes megatron's copy-to-TP region
  (its backward all-reduces ``dh``, so ``A``'s gradient is whole). ``y = s * B_local h`` is placed
  at the rank's rows of the fused output (GQA-interleaved q/k/v, [gate; up]).
- row-parallel: ``y = s * B (A_local x_local)`` is added to the partial output before megatron's
  all-reduce / reduce-scatter, which sums it over TP with the base output (no extra
  communication); ``B``'s gradient is then partial and summed over TP.
- DoRA: the output rows are scaled by ``m / ||W + s B A||`` (norm over the input dimension,
  detached as in PEFT); in row-parallel layers the squared norms are summed over TP.

Gradient bookkeeping: TP-sharded adapter tensors carry megatron's ``tensor_model_parallel`` tags
(DeepSpeed's grad norm counts them on every TP rank), partial ones ``tp_partial_grad``
(``toolkit.parallel.grads.finalize_grads`` sums them over TP). Only adapter parameters train.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from toolkit.lora.plan import COLUMN, ROW, AdapterSlice

A, B, M = "lora_A", "lora_B", "lora_magnitude_vector"


class Magnitude(torch.nn.Module):
    """DoRA's magnitude vector (a module, so that ZeRO-3 gathers it when it is read)."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n, dtype=dtype, device=device))

    def forward(self) -> torch.Tensor:
        return self.weight * 1  # a tensor of this call: ZeRO-3 may release the parameter after


class LoraPair(torch.nn.Module):
    """One HF projection's adapter as this rank holds it (``AdapterSlice``), laid out as PEFT's
    (``lora_A`` and ``lora_B`` linear modules, DoRA's ``lora_magnitude_vector``): each tensor is
    used through its module's forward, which is where DeepSpeed ZeRO-3 gathers parameters."""

    def __init__(self, s: AdapterSlice, r: int, dora: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.slice = s
        self.lora_A = torch.nn.Linear(s.local_in, r, bias=False, dtype=dtype, device=device)
        self.lora_B = torch.nn.Linear(r, s.local_out, bias=False, dtype=dtype, device=device)
        self.lora_magnitude_vector = Magnitude(s.local_out, dtype, device) if dora else None

    def param(self, kind: str) -> torch.nn.Parameter | None:
        """The parameter of ``kind`` (``lora_A`` / ``lora_B`` / ``lora_magnitude_vector``)."""
        module = getattr(self, kind)
        return None if module is None else module.weight


class LoraBranch(torch.nn.Module):
    """The adapters of one megatron-core linear layer (every HF projection it fuses)."""

    def __init__(self, slices: Sequence[AdapterSlice], out_local: int, *, r: int, alpha: float,
                 dropout: float, dora: bool, rslora: bool, dtype: torch.dtype,
                 device: torch.device, tp_group: Any, sequence_parallel: bool):
        super().__init__()
        kinds = {s.kind for s in slices}
        if len(kinds) != 1:
            raise ValueError(f"{slices[0].linear}: column and row adapters on one layer")
        self.kind = kinds.pop()
        self.r, self.dora, self.enabled = r, dora, True
        self.dtype, self.device = dtype, device
        self.scaling = alpha / (math.sqrt(r) if rslora else r)
        self.pairs = torch.nn.ModuleDict({s.target: LoraPair(s, r, dora, dtype, device)
                                          for s in slices})
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        index = torch.full((out_local,), sum(s.local_out for s in slices), dtype=torch.long)
        at = 0
        for s in slices:
            for (a, b), (c, d) in s.out_rows:
                index[a:b] = torch.arange(at + c, at + d)
            at += s.local_out
        self.covered_all = bool((index < at).all())
        identity = self.covered_all and torch.equal(index, torch.arange(out_local))
        self.register_buffer("index", None if identity else index.to(device), persistent=False)
        self._mark()

    def _mark(self) -> None:
        """Megatron-core / DeepSpeed tags: which adapter tensors are TP shards, which have
        gradients that are partial over TP."""
        for pair in self.pairs.values():
            for name in (A, B, M):
                p = pair.param(name)
                if p is None:
                    continue
                p.allreduce = True
                sharded = (name == A) == (self.kind == ROW)
                if self.tp > 1 and sharded:
                    p.tensor_model_parallel, p.partition_stride = True, 1
                    p.partition_dim = 1 if self.kind == ROW else 0
                partial = self.kind == ROW if name != A else self.sequence_parallel
                if self.tp > 1 and partial and not sharded:
                    p.tp_partial_grad = True

    def _place(self, rows: torch.Tensor, pad: float, dim: int = -1) -> torch.Tensor:
        """Per-projection rows (concatenated along ``dim``) at the rows of the fused output."""
        if self.index is None:
            return rows
        if not self.covered_all:
            shape = list(rows.shape)
            shape[dim] = 1
            rows = torch.cat([rows, rows.new_full(shape, pad)], dim)
        return rows.index_select(dim, self.index)

    def forward(self, x: torch.Tensor, base: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        pairs = list(self.pairs.values())
        x = self.dropout(x)
        h = torch.cat([p.lora_A(x) for p in pairs], -1)
        if self.kind == COLUMN and self.tp > 1:
            if self.sequence_parallel:
                h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True,
                                                         group=self.tp_group)
            else:
                h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        ys = [p.lora_B(hi) for hi, p in zip(h.split(self.r, -1), pairs, strict=True)]
        y = self._place(torch.cat(ys, -1), 0.0) * self.scaling
        if not self.dora:
            return base + y
        return (base + y) * self.dora_scale(weight).to(base.dtype)

    def lora_weight(self) -> torch.Tensor:
        """``B A`` of every projection, at its rows of the local weight (zeros elsewhere),
        computed through the modules as PEFT does (``B(A(I))^T``: ZeRO-3 gathers them)."""
        rows = []
        for p in self.pairs.values():
            eye = torch.eye(p.slice.local_in, dtype=self.dtype, device=self.device)
            rows.append(p.lora_B(p.lora_A(eye)).T)
        return self._place(torch.cat(rows, 0), 0.0, dim=0)

    def _plus_adapter(self, weight: torch.Tensor) -> torch.Tensor:
        """``W + s B A`` of the local weight, in fp32."""
        return weight.float() + self.scaling * self.lora_weight().float()

    @torch.no_grad()
    def _row_norm(self, merged: torch.Tensor) -> torch.Tensor:
        """Per output row of a local weight, its norm over the whole input."""
        sq = merged.pow(2).sum(1)
        if self.kind == ROW and self.tp > 1:
            dist.all_reduce(sq, group=self.tp_group)
        return sq.sqrt()

    def weight_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """``||W + s B A||`` per output row of the local weight (over the whole input)."""
        return self._row_norm(self._plus_adapter(weight))

    @torch.no_grad()
    def folded(self, weight: torch.Tensor) -> torch.Tensor:
        """The local weight with the adapter in it (fp32): ``W + s B A``, DoRA's rows scaled by
        ``m / ||W + s B A||``; what the layer computes, as one matrix."""
        merged = self._plus_adapter(weight)
        if self.dora:
            merged = merged * self.dora_scale(weight, self._row_norm(merged)).unsqueeze(1)
        return merged

    def dora_scale(self, weight: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
        m = torch.cat([p.lora_magnitude_vector() for p in self.pairs.values()])
        norm = self.weight_norm(weight) if norm is None else norm
        scale = self._place(m.float(), 1.0) / norm
        if not self.covered_all:
            scale = torch.where(self.index < m.numel(), scale, torch.ones_like(scale))
        return scale

    @torch.no_grad()
    def reset_magnitude(self, weight: torch.Tensor) -> None:
        """DoRA's initial magnitude: ``||W + s B A||`` of the rows each projection holds."""
        norm = self.weight_norm(weight)
        for p in self.pairs.values():
            m = p.param(M)
            for (a, b), (c, d) in p.slice.out_rows:
                m[c:d] = norm[a:b].to(m.dtype)


class LoraLinear:
    """Mixin put in front of a megatron-core parallel linear class by ``attach``."""

    lora: LoraBranch

    def _forward_impl(self, input, weight, bias=None, **kwargs):  # noqa: A002 - megatron's name
        branch = self.lora
        if not branch.enabled:
            return super()._forward_impl(input=input, weight=weight, bias=bias, **kwargs)
        dora_bias = bias if branch.dora else None
        out = super()._forward_impl(input=input, weight=weight,
                                    bias=None if branch.dora else bias, **kwargs)
        out = branch(input, out, weight)
        return out if dora_bias is None else out + dora_bias


_CLASSES: dict[type, type] = {}


def lora_class(cls: type) -> type:
    """``cls`` with the LoRA branch (one subclass per class, made once)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (LoraLinear, cls), {"__module__": __name__})
    return _CLASSES[cls]


def branches(chunks: Sequence[torch.nn.Module]) -> Iterator[tuple[int, str, LoraBranch]]:
    """(chunk, linear module name, branch) of every adapted layer of the chunks."""
    for i, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, LoraLinear):
                yield i, name, module.lora


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run the chunks as the frozen base model (every adapter switched off) inside the block:
    e.g. DPO's reference model when LoRA is on. Not re-entrant across threads."""
    found = [b for _, _, b in branches(chunks)]
    before = [b.enabled for b in found]
    for b in found:
        b.enabled = False
    try:
        yield
    finally:
        for b, state in zip(found, before, strict=True):
            b.enabled = state


def linear_kind(module: torch.nn.Module) -> str | None:
    if isinstance(module, ColumnParallelLinear):
        return COLUMN
    if isinstance(module, RowParallelLinear):
        return ROW
    return None


@contextlib.contextmanager
def merged(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Every adapter folded into its layer's local weight inside the block (``W + s B A``;
    DoRA: its rows scaled by ``m / ||W + s B A||``), the branches off: the chunks then hold
    what an engine that knows no LoRA reads (vLLM's weight stream). The weights are restored
    bit for bit after. Collective with DoRA at tp > 1 (the norms' all-reduce)."""
    layers = [m for c in chunks for m in c.modules() if isinstance(m, LoraLinear)]
    saved = []
    with torch.no_grad():
        for m in layers:
            value = m.lora.folded(m.weight)
            saved.append((m.weight.detach().clone(), m.lora.enabled))
            m.weight.copy_(value.to(m.weight.dtype))
            m.lora.enabled = False
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (weight, enabled) in zip(layers, saved, strict=True):
                m.weight.copy_(weight)
                m.lora.enabled = enabled
