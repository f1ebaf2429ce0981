"""HF folders whose stored tensors stack many mapped tensors (``toolkit.mapping.stacked``),
read and written under the members' names.

``StackedReader`` wraps a slice reader: each stacked tensor disappears from ``names`` and its
members take its place; reading a member reads that member's index of the stored tensor (one
expert's block, never the whole stack) and takes its columns. ``StackingWriter`` wraps an
``HFWriter``: members are collected into their stored tensor, which is written once its last
member arrives (memory: the stacks being filled; an export writes a layer's experts one after
another), and a plan (``HFWriter(plan=...)``) is translated to the stored names and shapes.
Everything else passes through, so the rest of mdtk sees only members.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.source import TensorSource
from toolkit.checkpoint.wrapped import WrappedReader
from toolkit.lazy import torch
from toolkit.mapping.stacked import Member, Stack

Region = tuple[tuple[int, int], ...]


def _view(t: torch.Tensor, m: Member) -> torch.Tensor:
    """Member ``m`` of the stored slab ``t`` (the stored tensor at ``m.index``)."""
    t = t[..., m.start::m.step]
    return t.transpose(-1, -2) if m.transpose else t


class StackedReader(WrappedReader):
    """A slice reader presenting the members of ``stacks`` in place of their stored tensors."""

    def __init__(self, inner: TensorSource, stacks: Sequence[Stack], base_prefix: str = ""):
        self.inner = inner
        self.path = getattr(inner, "path", None)
        names = list(inner.names)
        present = set(names)
        self.members: dict[str, tuple[Stack, Member]] = {}
        by_stored: dict[str, Stack] = {}
        for stack in stacks:
            if stack.stored not in present and base_prefix and stack.stored.startswith(
                    base_prefix) and stack.stored[len(base_prefix):] in present:
                stack = stack.renamed(base_prefix, "")  # saved from the base model class
            if stack.stored not in present:
                continue  # the adapter names what is missing (``match_checkpoint``)
            if hasattr(inner, "expect"):  # MXFP4 blocks: their orientation (``mxfp4``)
                inner.expect(stack.stored, stack.shape)
            got = tuple(inner.shape(stack.stored))
            if got != stack.shape:
                raise CheckpointError(f"{self.path}: {stack.stored} has shape {got}, the model's "
                                      f"config gives {stack.shape}: config.json and weights "
                                      "must be of the same model.")
            by_stored[stack.stored] = stack
            self.members.update((m.name, (stack, m)) for m in stack.members)
        self._names = []
        for name in names:
            stack = by_stored.get(name)
            self._names += [m.name for m in stack.members] if stack else [name]
        self._slab: tuple[str, int, torch.Tensor] | None = None

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.members:
            stack, m = self.members[name]
            return stack.member_shape(m)
        return tuple(self.inner.shape(name))

    def dtype(self, name: str) -> Any:
        return self.inner.dtype(self.members[name][0].stored if name in self.members else name)

    def stored_dtype(self, name: str) -> Any:
        stored = self.members[name][0].stored if name in self.members else name
        return getattr(self.inner, "stored_dtype", self.inner.dtype)(stored)

    def locate(self, name: str) -> Any:
        return self.inner.locate(self.members[name][0].stored if name in self.members else name)

    def byte_range(self, name: str, region: Region) -> Any:
        """Members are strided views: never copied as bytes."""
        inner = getattr(self.inner, "byte_range", None)
        return None if name in self.members or inner is None else inner(name, region)

    def dequantize_to(self, dtype: Any) -> None:
        if hasattr(self.inner, "dequantize_to"):
            self.inner.dequantize_to(dtype)

    def read(self, name: str, region: Region) -> torch.Tensor:
        if name not in self.members:
            return self.inner.read(name, region)
        stack, m = self.members[name]
        if self._slab is None or self._slab[:2] != (stack.stored, m.index):
            full = ((m.index, m.index + 1), *((0, n) for n in stack.shape[1:]))
            self._slab = (stack.stored, m.index, self.inner.read(stack.stored, full)[0])
        part = _view(self._slab[2], m)
        return part[tuple(slice(a, b) for a, b in region)].contiguous()

    def close(self) -> None:
        self._slab = None
        self.inner.close()



def stacked(reader: TensorSource, stacks: Sequence[Stack], base_prefix: str = ""
            ) -> TensorSource:
    """``reader`` itself when ``stacks`` is empty, else a ``StackedReader`` over it."""
    return StackedReader(reader, stacks, base_prefix) if stacks else reader


class Stacker:
    """Members collected into their stored tensors: ``add`` hands back what is ready to write.

    A member goes into its stack's full tensor (made at its first member); the stack comes back
    once its last member arrives; any other tensor comes back at once. A member given as None
    is only counted (a rank that does not hold the data stays in step with one that does: its
    stack comes back as None at the same point). Memory: the stacks being filled.
    """

    def __init__(self, stacks: Sequence[Stack]):
        self.members = {m.name: (s, m) for s in stacks for m in s.members}
        self.filling: dict[str, tuple[torch.Tensor | None, set[str]]] = {}

    def add(self, name: str, tensor: torch.Tensor | None
            ) -> list[tuple[str, torch.Tensor | None]]:
        """What ``name`` completes: ``[(name, tensor)]`` for a tensor of no stack, its stack's
        ``[(stored, full)]`` for the last member of a stack, else ``[]``."""
        if name not in self.members:
            return [(name, tensor)]
        stack, m = self.members[name]
        if stack.stored not in self.filling:
            full = None if tensor is None else torch.empty(stack.shape, dtype=tensor.dtype)
            self.filling[stack.stored] = (full, set())
        full, done = self.filling[stack.stored]
        if name in done:
            raise CheckpointError(f"tensor {name!r} written twice.")
        if full is not None and tensor is not None:
            if tensor.dtype != full.dtype or tuple(tensor.shape) != stack.member_shape(m):
                raise CheckpointError(f"{name}: {tuple(tensor.shape)} {tensor.dtype}, its stack "
                                      f"{stack.stored} needs {stack.member_shape(m)} "
                                      f"{full.dtype}.")
            _view(full[m.index], m).copy_(tensor)
        done.add(name)
        if len(done) < len(stack.members):
            return []
        del self.filling[stack.stored]
        return [(stack.stored, full)]

    def unfinished(self) -> str | None:
        """Why the stacks cannot be written yet (a stack missing members), or None."""
        if not self.filling:
            return None
        stored, (_, done) = next(iter(self.filling.items()))
        total = sum(1 for s, _ in self.members.values() if s.stored == stored)
        return f"{stored}: only {len(done)} of its {total} members were written."


class StackingWriter:
    """An ``HFWriter`` that takes members and writes their stored tensors (module docstring)."""

    def __init__(self, inner: Any, stacks: Sequence[Stack]):
        self.inner = inner
        self.stacker = Stacker(stacks)

    @property
    def out_dir(self) -> Any:
        return self.inner.out_dir

    def add(self, name: str, tensor: torch.Tensor) -> None:
        for stored, full in self.stacker.add(name, tensor):
            self.inner.add(stored, full)

    def add_segments(self, name: str, segments: list) -> None:
        if name in self.stacker.members:
            raise CheckpointError(f"{name} is part of a stacked tensor: it cannot be copied as "
                                  "bytes.")
        self.inner.add_segments(name, segments)

    def finish(self, config: Any, **kwargs: Any) -> Any:
        if (problem := self.stacker.unfinished()) is not None:
            self.abort()
            raise CheckpointError(problem)
        return self.inner.finish(config, **kwargs)

    def abort(self) -> None:
        self.stacker.filling.clear()
        self.inner.abort()

    def __getattr__(self, name: str) -> Any:  # fsync and the other writer settings
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("inner", "stacker"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)


def stored_plan(plan: dict[str, tuple[tuple[int, ...], Any]], stacks: Sequence[Stack]
                ) -> dict[str, tuple[tuple[int, ...], Any]]:
    """An ``HFWriter`` plan over members (in the order they will be added) turned into one over
    the stored tensors: each at the place of its last member, where ``StackingWriter`` adds it,
    with its members' dtype."""
    owner = {m.name: s for s in stacks for m in s.members}
    last = {owner[n].stored: n for n in plan if n in owner}
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for name, (shape, dtype) in plan.items():
        stack = owner.get(name)
        if stack is None:
            out[name] = (shape, dtype)
        elif last[stack.stored] == name:
            out[stack.stored] = (stack.shape, dtype)
    return out
