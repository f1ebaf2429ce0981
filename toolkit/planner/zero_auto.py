"""``mdtk ds-config`` with recompute and ZeRO++ chosen too: the planner's fit test and cost model
applied to the parts a DeepSpeed config owns (ZeRO stage, offload, ZeRO++) plus activation
recompute.

Offload is the last resort: every stage with every recompute level is tried without offload
first, then with CPU offload, then NVMe. Within a tier the fitting option with the lowest
estimated step time wins (ties: the earlier option, least communication and least recompute
first). Recompute is a trainer setting, not a DeepSpeed key, so the chosen level is reported in
the notes (HF Trainer: ``gradient_checkpointing=True``, which has no selective mode).

ZeRO++ (``toolkit.planner.zeropp``): on several nodes with pure data parallelism every ZeRO-3
option is also costed with hpZ (the GPUs per node), and with qwZ / qgZ when the request allows
lossy communication. Of one option's variants the fastest that fits wins; within 0.1% the exact
ones (no quantization) come first, then the fewest cross-node bytes (so hpZ is taken when the
network time already hides behind compute: same step, less traffic, exact).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from toolkit import rules
from toolkit.dsconfig.generator import (
    CPU,
    NVME,
    Option,
    Plan,
    Request,
    build_config,
    evaluate,
    nothing_fits,
    request_zero,
    validate_request,
    with_zeropp,
)
from toolkit.memory import ZeroOptions, num_microbatches
from toolkit.parallel.layout import ResolvedLayout
from toolkit.planner.cost import MDTK, Candidate, Efficiency, Network, StepCost, Workload
from toolkit.planner.devices import DEVICES, Device
from toolkit.planner.step import step_cost
from toolkit.planner.zeropp_notes import Scored, zeropp_notes

TIERS = ("none", CPU, NVME)
TIE = 1e-3  # step times this close count as equal


@dataclass(frozen=True)
class AutoPlan(Plan):
    """``Plan`` with the step costs behind a ZeRO-3 choice: "chosen", "plain" (the same option
    without ZeRO++) and "quantized" (the best lossy variant), where they were costed."""

    costs: dict[str, StepCost] = field(default_factory=dict)


def _candidate(req: Request, layout: ResolvedLayout, zero: ZeroOptions, recompute: str
               ) -> Candidate:
    offload = "none"
    if zero.offload_optimizer != "none":
        offload = "all" if zero.offload_param != "none" else "optimizer"
    return Candidate(tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp,
                     ep=layout.ep, vpp=layout.vpp or 1, zero=zero.stage, offload=offload,
                     recompute=recompute, micro_batch=req.train.micro_batch, hpz=zero.hpz,
                     qwz=zero.quantized_weights, qgz=zero.quantized_gradients)


def recompute_note(recompute: str, hf_trainer: bool) -> str:
    if hf_trainer:
        return ("activation recompute is needed: turn on gradient checkpointing "
                "(TrainingArguments(gradient_checkpointing=True) or "
                "model.gradient_checkpointing_enable()); DeepSpeed's JSON has no key for it.")
    megatron = ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
                if recompute == "full" else "--recompute-granularity selective")
    return (f"activation recompute '{recompute}' is needed: it is a trainer setting, not a "
            f"DeepSpeed key (mdtk: train.recompute: {recompute}; Megatron-LM: {megatron}; "
            "HF Trainer: gradient_checkpointing=True).")


def zeropp_eligible(req: Request, layout: ResolvedLayout) -> str | None:
    """Why ZeRO++ is not weighed for this request, or None when it is."""
    g = req.cluster.gpus_per_node
    if req.cluster.nodes < 2:
        return "one node (hpZ and qgZ only change cross-node traffic)"
    if (mixed := rules.zeropp_groups_problem(layout.tp, layout.pp)) is not None:
        return mixed
    if layout.dp_cp % g:
        return f"the data-parallel size {layout.dp_cp} is not a multiple of {g} GPUs per node"
    return None


def zeropp_variants(req: Request, layout: ResolvedLayout, zero: ZeroOptions
                    ) -> list[ZeroOptions]:
    """``zero`` and, at stage 3 where ZeRO++ is weighed, its variants (plain first): hpZ over
    the node's GPUs unless the request fixes it, qwZ / qgZ when allowed (or fixed)."""
    if zero.stage != 3 or zero.offload_param != "none" or zeropp_eligible(req, layout):
        return [zero]  # (offloaded parameters: hpZ's copy would sit on the host too)
    allow = req.allow_quantized_comm
    hpzs = [zero.hpz] if req.hpz is not None else [1, req.cluster.gpus_per_node]
    qws = [zero.quantized_weights] if req.quantized_weights is not None else (
        [False, True] if allow else [False])
    qgs = [zero.quantized_gradients] if req.quantized_gradients is not None else (
        [False, True] if allow else [False])
    return [with_zeropp(zero, h, w, q) for w in qws for q in qgs for h in hpzs]


def best_variant(scored: list[Scored]) -> Scored:
    """The fastest; within ``TIE`` the exact ones first, then the fewest cross-node bytes."""
    fastest = min(s.cost.step for s in scored)
    near = [s for s in scored if s.cost.step <= fastest * (1 + TIE)]
    exact = [s for s in near if not s.lossy] or near
    return min(exact, key=lambda s: (s.cost.cross_node_bytes, s.order))


def zero_auto(req: Request, device: Device = DEVICES["h100"], eff: Efficiency | None = None
              ) -> Plan:
    """Choose stage, offload, recompute and ZeRO++ for ``req`` (its ``train.recompute`` is
    ignored)."""
    layout = validate_request(req)
    levels = rules.HF_RECOMPUTE if req.hf_trainer else rules.RECOMPUTE
    tiers = TIERS if req.offload == "auto" else (req.offload,)
    dp = layout.dp
    global_batch = req.train.global_batch or req.train.micro_batch * dp
    num_microbatches(dataclasses.replace(req.train, global_batch=global_batch), dp)  # divisible?
    work = Workload(req.train.seq_len, global_batch, req.train.dtype, pairs=req.train.pairs,
                    reference_model=req.train.reference_model)
    net = Network(device, req.cluster.gpus_per_node)
    considered: list[Option] = []
    for tier in tiers:
        best: list[tuple[Scored, list[Scored]]] = []
        for zero in request_zero(dataclasses.replace(req, offload=tier)):
            for recompute in levels:
                sub = dataclasses.replace(req, train=dataclasses.replace(req.train,
                                                                         recompute=recompute))
                scored = []
                for variant in zeropp_variants(req, layout, zero):
                    option = dataclasses.replace(evaluate(sub, variant, layout),
                                                 recompute=recompute)
                    considered.append(option)
                    if option.fits:
                        cost = step_cost(req.model, work, _candidate(sub, layout, variant,
                                                                     recompute), net, MDTK, eff)
                        scored.append(Scored(option, sub, cost, len(considered)))
                if scored:
                    best.append((best_variant(scored), scored))
        if best:
            chosen, variants = min(best, key=lambda b: (b[0].cost.step, b[0].order))
            return _plan(req, layout, chosen, variants, considered, work, net, eff)
    raise nothing_fits(req, layout, considered)


def _plan(req: Request, layout: ResolvedLayout, chosen: Scored, variants: list[Scored],
          considered: list[Option], work: Workload, net: Network, eff: Efficiency | None
          ) -> AutoPlan:
    notes: list[str] = []
    option = chosen.option
    if option.recompute != "none":
        notes.append(recompute_note(str(option.recompute), req.hf_trainer))
    costs: dict[str, StepCost] = {"chosen": chosen.cost}
    if option.zero.stage == 3:
        plain = _plain_cost(req, layout, chosen, work, net, eff)
        lossy = [s for s in variants if s.lossy]
        exact = [s for s in variants if not s.lossy]
        costs["plain"] = plain
        if exact:
            costs["exact"] = best_variant(exact).cost
        if lossy:
            costs["quantized"] = min(lossy, key=lambda s: s.cost.step).cost
        elif not req.allow_quantized_comm and not zeropp_eligible(req, layout):
            full = with_zeropp(option.zero, req.cluster.gpus_per_node, True, True)
            costs["quantized"] = step_cost(req.model, work, _candidate(
                chosen.request, layout, full, str(option.recompute)), net, MDTK, eff)
        notes += zeropp_notes(req, option, costs, zeropp_eligible(req, layout), variants)
    config = build_config(chosen.request, option, layout, notes)
    return AutoPlan(config, option, tuple(considered), tuple(notes), costs)


def _plain_cost(req: Request, layout: ResolvedLayout, chosen: Scored, work: Workload,
                net: Network, eff: Efficiency | None) -> StepCost:
    plain = with_zeropp(chosen.option.zero)
    if plain == chosen.option.zero:
        return chosen.cost
    return step_cost(req.model, work, _candidate(chosen.request, layout, plain,
                                                 str(chosen.option.recompute)), net, MDTK, eff)
