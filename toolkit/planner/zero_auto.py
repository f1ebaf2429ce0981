"""``mdtk ds-config`` with recompute chosen too: the planner's fit test and cost model applied to
the parts a DeepSpeed config owns (ZeRO stage, offload) plus activation recompute.

Offload is the last resort: every stage with every recompute level is tried without offload
first, then with CPU offload, then NVMe. Within a tier the fitting option with the lowest
estimated step time wins (ties: the earlier option, least communication and least recompute
first). Recompute is a trainer setting, not a DeepSpeed key, so the chosen level is reported in
the notes (HF Trainer: ``gradient_checkpointing=True``, which has no selective mode).
"""

from __future__ import annotations

import dataclasses

from toolkit.dsconfig.generator import (
    CPU,
    NVME,
    Option,
    Plan,
    Request,
    build_config,
    candidate_zero,
    evaluate,
    nothing_fits,
    validate_request,
)
from toolkit.memory import ZeroOptions, num_microbatches
from toolkit.planner.cost import MDTK, Candidate, Efficiency, Network, Workload
from toolkit.planner.devices import DEVICES, Device
from toolkit.planner.step import step_cost

TIERS = ("none", CPU, NVME)


def _candidate(req: Request, zero: ZeroOptions, recompute: str) -> Candidate:
    layout = req.layout.resolve(req.cluster.world_size)
    offload = "none"
    if zero.offload_optimizer != "none":
        offload = "all" if zero.offload_param != "none" else "optimizer"
    return Candidate(tp=layout.tp, pp=layout.pp, dp=int(layout.dp or 1), cp=layout.cp,
                     ep=layout.ep, vpp=layout.vpp or 1, zero=zero.stage, offload=offload,
                     recompute=recompute, micro_batch=req.train.micro_batch)


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


def zero_auto(req: Request, device: Device = DEVICES["h100"], eff: Efficiency | None = None
              ) -> Plan:
    """Choose stage, offload and recompute for ``req`` (its ``train.recompute`` is ignored)."""
    layout = validate_request(req)
    levels = ("none", "full") if req.hf_trainer else ("none", "selective", "full")
    tiers = TIERS if req.offload == "auto" else (req.offload,)
    dp = int(layout.dp or 1)
    global_batch = req.train.global_batch or req.train.micro_batch * dp
    num_microbatches(dataclasses.replace(req.train, global_batch=global_batch), dp)  # divisible?
    work = Workload(req.train.seq_len, global_batch, req.train.dtype, pairs=req.train.pairs,
                    reference_model=req.train.reference_model)
    net = Network(device, req.cluster.gpus_per_node)
    considered: list[Option] = []
    for tier in tiers:
        fitting: list[tuple[float, int, Option, Request]] = []
        for zero in candidate_zero(req.model, req.stage, tier):
            for recompute in levels:
                sub = dataclasses.replace(req, train=dataclasses.replace(req.train,
                                                                         recompute=recompute))
                option = dataclasses.replace(evaluate(sub, zero), recompute=recompute)
                considered.append(option)
                if option.fits:
                    cost = step_cost(req.model, work, _candidate(sub, zero, recompute), net,
                                     MDTK, eff)
                    fitting.append((cost.step, len(considered), option, sub))
        if fitting:
            _, _, chosen, sub = min(fitting, key=lambda f: (f[0], f[1]))
            notes: list[str] = []
            if chosen.recompute != "none":
                notes.append(recompute_note(str(chosen.recompute), req.hf_trainer))
            config = build_config(sub, chosen, layout, notes)
            return Plan(config, chosen, tuple(considered), tuple(notes))
    raise nothing_fits(req, layout, considered)
