"""Why a ZeRO-3 config has (or has not) DeepSpeed's ZeRO++ options: the sentences ``mdtk
ds-config`` prints, with the modeled step time and cross-node bytes with and without them."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.dsconfig.generator import Option, Request
from toolkit.memory import GIB
from toolkit.planner.cost import StepCost

GB = 1e9
LOSSY = ("lossy: int8 parameter gathers (qwZ) and int4 gradient reduction (qgZ), in DeepSpeed's "
         "CUDA quantizer kernels (GPUs only)")


@dataclass(frozen=True)
class Scored:
    """One option that fits, with its step cost (here, below zero_auto, which ranks them)."""

    option: Option
    request: Request
    cost: StepCost
    order: int

    @property
    def lossy(self) -> bool:
        return self.option.zero.quantized_weights or self.option.zero.quantized_gradients


def _traffic(cost: StepCost) -> str:
    return f"step {cost.step:.3g} s, {cost.cross_node_bytes / GB:.3g} GB cross-node per GPU"


def zeropp_notes(req: Request, option: Option, costs: dict[str, StepCost], not_weighed: str | None,
                 variants: list[Scored]) -> list[str]:
    """The notes of a ZeRO-3 choice: what ZeRO++ does here and why it was taken or not."""
    z = option.zero
    if not_weighed is not None:
        return [f"ZeRO++ (hpZ, qwZ, qgZ) not weighed: {not_weighed.rstrip('.')}."]
    chosen, plain = costs["chosen"], costs["plain"]
    notes = []
    g = req.cluster.gpus_per_node
    if z.hpz > 1:
        secondary = sum(i.bytes for i in option.estimate.items if i.what.startswith("hpZ"))
        text = (f"ZeRO++ hpZ (zero_hpz_partition_size={z.hpz}, the GPUs per node): a secondary "
                "copy of the parameters sharded inside the node serves every gather of a step "
                "but the first (the backward ones and the forwards of later micro-batches), so "
                f"they stay on NVLink. Modeled {_traffic(chosen)} with it; {_traffic(plain)} "
                f"with plain ZeRO-3. Costs {secondary / GIB:.2f} GiB per GPU for the copy.")
        if abs(chosen.step - plain.step) <= 1e-3 * plain.step:
            text += (" The step is the same: on this network plain ZeRO-3's traffic already "
                     "hides behind compute; hpZ is taken for the cross-node bytes it saves "
                     "(exact, and it fits).")
        notes.append(text)
    elif not any(s.option.zero.hpz > 1 for s in variants):
        notes.append(f"ZeRO++ hpZ ({g}) weighed but it does not fit: its secondary parameter "
                     "copy needs more GPU memory than is left.")
    notes += _quantized_notes(req, z, costs)
    return notes


def _quantized_notes(req: Request, z, costs: dict[str, StepCost]) -> list[str]:
    chosen, quantized = costs["chosen"], costs.get("quantized")
    if z.quantized_weights or z.quantized_gradients:
        exact = costs.get("exact", costs["plain"])
        given = "--allow-quantized-comm" if req.allow_quantized_comm else "the request"
        return [f"qwZ/qgZ chosen ({given} allows them): {LOSSY}. Modeled {_traffic(chosen)}, "
                f"against {_traffic(exact)} for the best option without them."]
    if quantized is None:
        return []
    if req.allow_quantized_comm:
        return [f"qwZ/qgZ allowed but not taken: they do not pay here (best with them "
                f"{_traffic(quantized)}; their kernels cost more than the bytes they save)."]
    if quantized.step < chosen.step * (1 - 1e-3):
        return [f"hpZ + qwZ + qgZ would give {_traffic(quantized)}, but qwZ/qgZ "
                f"are {LOSSY}: allow them with --allow-quantized-comm."]
    return []
