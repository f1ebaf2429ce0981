"""Stored tensors that hold many of the tensors a mapping reads: one HF tensor per expert stacked
along a first dimension (GPT-OSS's ``mlp.experts.gate_up_proj [experts, hidden, 2 * ffn]``).

The mapping (``Table``) is written over *members*: one named tensor per expert and projection, in
``nn.Linear``'s ``[out, in]`` orientation, so every split rule, plan, LoRA slice and converter
path works unchanged. A ``Stack`` says how its members sit in the stored tensor; the checkpoint
layer applies it where an HF folder is read or written (``toolkit.checkpoint.stacked``), so no
other format ever sees a stacked name. Member ``e`` of a stored tensor ``S`` is
``S[index][..., start::step]`` (transposed when ``transpose``): the step takes one of the
interleaved gate / up columns GPT-OSS stores side by side. Torch-free: families declare stacks.
"""

from __future__ import annotations

from dataclasses import dataclass

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Member:
    """One tensor of a stack: ``stored[index][..., start::step]``, transposed if ``transpose``."""

    name: str
    index: int
    start: int = 0
    step: int = 1
    transpose: bool = False


@dataclass(frozen=True)
class Stack:
    """A stored tensor of shape ``shape`` and the members it holds (every element once)."""

    stored: str
    shape: Shape
    members: tuple[Member, ...]

    def member_shape(self, m: Member) -> Shape:
        """The shape of member ``m`` as the mapping sees it."""
        inner = list(self.shape[1:])
        inner[-1] = len(range(m.start, inner[-1], m.step))
        return tuple(reversed(inner)) if m.transpose else tuple(inner)

    def renamed(self, old: str, new: str) -> Stack:
        """This stack with the name prefix ``old`` replaced by ``new`` (``base_prefix``-less
        checkpoints saved from a family's base class)."""
        def swap(name: str) -> str:
            return new + name[len(old):] if name.startswith(old) else name

        return Stack(swap(self.stored), self.shape,
                     tuple(Member(swap(m.name), m.index, m.start, m.step, m.transpose)
                           for m in self.members))


def fused_experts(block: str, experts: int, hidden: int, ffn: int, *,
                  names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                  bias: bool = True) -> list[Stack]:
    """Routed experts stored fused and ``[in, out]`` under ``block`` (GPT-OSS):
    ``gate_up_proj [E, hidden, 2 * ffn]`` (gate and up columns interleaved: gate at even,
    up at odd columns), ``down_proj [E, ffn, hidden]`` and, with ``bias``,
    ``gate_up_proj_bias [E, 2 * ffn]`` and ``down_proj_bias [E, hidden]``; members
    ``{block}{e}.<name>.weight|bias``, as ``builders.experts`` names them."""
    gate, up, down = names

    def gate_up(kind: str, transpose: bool) -> tuple[Member, ...]:
        return tuple(Member(f"{block}{e}.{n}.{kind}", e, start, 2, transpose)
                     for e in range(experts) for n, start in ((gate, 0), (up, 1)))

    def each(kind: str, transpose: bool) -> tuple[Member, ...]:
        return tuple(Member(f"{block}{e}.{down}.{kind}", e, transpose=transpose)
                     for e in range(experts))

    stacks = [Stack(f"{block}gate_up_proj", (experts, hidden, 2 * ffn), gate_up("weight", True)),
              Stack(f"{block}down_proj", (experts, ffn, hidden), each("weight", True))]
    if bias:
        stacks += [Stack(f"{block}gate_up_proj_bias", (experts, 2 * ffn), gate_up("bias", False)),
                   Stack(f"{block}down_proj_bias", (experts, hidden), each("bias", False))]
    return stacks
