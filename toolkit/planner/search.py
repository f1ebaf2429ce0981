"""The plan search: enumerate layouts x ZeRO x offload x recompute x micro-batch, keep what the
memory model says fits, rank by the cost model's step time.

Candidates are costed first (cheap) and checked against the memory model in order of their
estimated time until ``top`` distinct plans fit, so large clusters stay fast; every returned plan
has passed the same fit test ``mdtk ds-config`` applies (``toolkit.dsconfig.generator.evaluate``:
10% headroom plus a 2 GiB reserve on the GPU, host RAM for offload).

Rules are what mdtk can train (``toolkit.rules``, which the trainer's checks, the lint and the
memory model ask too): tp within a node and dividing heads, query groups and the MLP width
(sequence parallelism always on with tp > 1); pp dividing the layers (vpp the layers per stage,
with micro-batches a multiple of pp); ZeRO-2/3 only with pp = 1; ZeRO-3 not with experts; ZeRO-0
not with pp > 1 or experts (DeepSpeed's ZeRO-0 clipping norm); optimizer offload with ZeRO-2/3,
parameter offload with ZeRO-3 (the generator's options). Context parallelism (mdtk's all-gather
CP attention, no Transformer Engine) is searched only with ``allow_cp`` and never for models it
cannot run (``ModelShape.cp_refusal``); its plans are runnable like any other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from toolkit import rules
from toolkit.dsconfig.generator import AUTO, Option, Request, evaluate, with_zeropp, zero_options
from toolkit.errors import UserError
from toolkit.memory import CPU, Cluster, Estimate, ModelShape, TrainShape, ZeroOptions
from toolkit.planner.cost import (
    MDTK,
    Candidate,
    Efficiency,
    Framework,
    Network,
    StepCost,
    Workload,
    stage_params,
)
from toolkit.planner.devices import Device
from toolkit.planner.step import step_cost


@dataclass(frozen=True)
class SearchSpace:
    """Which values each knob may take. ``fixed`` pins knobs by name (e.g. {"tp": 2})."""

    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offloads: tuple[str, ...] = ("none", "optimizer", "all")
    recomputes: tuple[rules.Recompute, ...] = rules.RECOMPUTE
    max_vpp: int = 8
    allow_cp: bool = False
    cps: tuple[int, ...] = (1, 2, 4, 8)
    fixed: tuple[tuple[str, int | str], ...] = ()
    zeropp: bool = True  # ZeRO-3 plans on several nodes also with hpZ (the GPUs per node)
    allow_quantized: bool = False  # ... and with the lossy qwZ / qgZ


@dataclass(frozen=True)
class Planned:
    """A plan that fits: its knobs, the cost model's step and the memory model's estimate."""

    candidate: Candidate
    cost: StepCost
    estimate: Estimate
    runnable: bool = True  # mdtk's trainer can run it here
    note: str = ""

    @property
    def mem_per_gpu(self) -> int:
        return self.estimate.gpu

    def to_dict(self, tokens: float | None = None, price: float | None = None) -> dict:
        c, k = self.candidate, self.cost
        out = {
            "tp": c.tp, "pp": c.pp, "vpp": c.vpp, "cp": c.cp, "ep": c.ep, "dp": c.dp,
            "sequence_parallel": c.sequence_parallel, "zero_stage": c.zero,
            "offload": c.offload, "recompute": c.recompute, "micro_batch": c.micro_batch,
            "num_microbatches": k.num_microbatches, "step_time_s": k.step,
            "tokens_per_s_per_gpu": k.tokens_per_s_per_gpu, "mfu": k.mfu,
            "mem_per_gpu_gib": self.estimate.gpu / 2**30,
            "host_mem_per_gpu_gib": self.estimate.total(CPU) / 2**30,
            "breakdown_s": k.breakdown(), "runnable_by_mdtk": self.runnable,
            "zeropp": {"hpz": c.hpz, "qwz": c.qwz, "qgz": c.qgz},
            "cross_node_gb_per_gpu": k.cross_node_bytes / 1e9,
        }
        if self.note:
            out["note"] = self.note
        if tokens:
            hours = tokens / (k.tokens_per_s_per_gpu * c.world_size) / 3600
            out["hours_for_tokens"] = hours
            out["gpu_hours_for_tokens"] = hours * c.world_size
            if price is not None:
                out["cost_for_tokens"] = hours * c.world_size * price
        return out


@dataclass(frozen=True)
class SearchResult:
    plans: tuple[Planned, ...]  # fastest first
    considered: int  # candidates that passed the rules and were costed
    rejected_memory: int  # costed candidates the memory model refused before the top was full
    workload: Workload
    cluster: Cluster
    reasons: tuple[str, ...] = field(default=())  # why nothing fits, when nothing does


class PlanError(UserError):
    """No plan can exist (rules) or none fits; the message says what to change."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_key(c: Candidate) -> tuple[int, int, int, int, int]:
    """A plan's layout (tp, pp, cp, ep, dp): the grouping for "one plan per layout"."""
    return (c.tp, c.pp, c.cp, c.ep, c.dp)


zero_allowed = rules.zero_allowed  # mdtk's rules with clipping on


def offload_allowed(zero: int, offload: str) -> bool:
    return offload == "none" or (offload == "optimizer" and zero >= 2) or (
        offload == "all" and zero == 3)


def candidates(model: ModelShape, work: Workload, world: int, gpus_per_node: int,
               space: SearchSpace = SearchSpace()) -> Iterator[Candidate]:
    """Every knob combination the rules allow for ``world`` ranks."""
    fixed = dict(space.fixed)
    moe = bool(model.experts)

    def choices(name: str, values) -> list:
        return [fixed[name]] if name in fixed else list(values)

    for tp in choices("tp", _divisors(gpus_per_node)):
        if world % tp or model.heads % tp or model.kv_heads % tp or model.ffn % tp or (
                moe and model.moe_ffn % tp):
            continue
        for cp in choices("cp", space.cps if space.allow_cp and not model.cp_refusal else (1,)):
            if work.seq_len % (2 * cp) and cp > 1 or world % (tp * cp):
                continue
            for pp in choices("pp", _divisors(model.layers)):
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                eps = [e for e in _divisors(model.experts) if (dp * cp * tp) % (e * tp) == 0
                       ] if moe else [1]
                zpp = zeropp_choices(space, world, gpus_per_node, tp, pp, dp * cp)
                for ep in choices("ep", eps):
                    yield from _knobs(model, work, space, fixed, tp, cp, pp, dp, ep, moe, zpp)


def zeropp_choices(space: SearchSpace, world: int, gpus_per_node: int, tp: int, pp: int,
                   dp_cp: int) -> list[tuple[int, bool, bool]]:
    """(hpz, qwz, qgz) to try with ZeRO-3: ZeRO++ only across nodes with pure data parallelism
    (DeepSpeed 0.19 builds hpZ's and qgZ's groups from consecutive world ranks), hpZ over the
    GPUs of a node, qwZ / qgZ only when lossy communication is allowed."""
    plain = [(1, False, False)]
    mixed = rules.zeropp_groups_problem(tp, pp) is not None
    if not space.zeropp or world <= gpus_per_node or mixed or dp_cp % gpus_per_node:
        return plain
    flags = [(False, False), (True, False), (False, True), (True, True)] \
        if space.allow_quantized else [(False, False)]
    return [(h, w, q) for w, q in flags for h in (1, gpus_per_node)]


def _knobs(model, work, space, fixed, tp, cp, pp, dp, ep, moe, zpp) -> Iterator[Candidate]:
    per_stage = model.layers // pp
    vpps = [1] if pp == 1 else [v for v in range(1, space.max_vpp + 1) if per_stage % v == 0]
    for mb in (fixed.get("micro_batch"),) if "micro_batch" in fixed else space.micro_batches:
        if work.global_batch % (mb * dp):
            continue
        m = work.global_batch // (mb * dp)
        for vpp in [fixed["vpp"]] if "vpp" in fixed else vpps:
            if vpp > 1 and m % pp:
                continue
            for zero in [fixed["zero"]] if "zero" in fixed else space.zero_stages:
                if not zero_allowed(zero, pp, moe):
                    continue
                for off in [fixed["offload"]] if "offload" in fixed else space.offloads:
                    if not offload_allowed(zero, off):
                        continue
                    variants = zpp if zero == 3 and off != "all" else [(1, False, False)]
                    for rc in [fixed["recompute"]] if "recompute" in fixed else space.recomputes:
                        for hpz, qwz, qgz in variants:
                            yield Candidate(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp,
                                            zero=zero, offload=off, recompute=rc,
                                            micro_batch=mb, hpz=hpz, qwz=qwz, qgz=qgz)


def zero_for(model: ModelShape, c: Candidate) -> ZeroOptions:
    """The DeepSpeed settings ``mdtk ds-config`` would write for this candidate."""
    opt = CPU if c.offload != "none" else "none"
    param = CPU if c.offload == "all" else "none"
    return with_zeropp(zero_options(model, c.zero, opt, param), c.hpz, c.qwz, c.qgz)


def train_shape(work: Workload, c: Candidate) -> TrainShape:
    return TrainShape(seq_len=work.seq_len, micro_batch=c.micro_batch,
                      global_batch=work.global_batch, dtype=work.dtype, recompute=c.recompute,
                      flash_attention=work.flash, fused=work.fused, pairs=work.pairs,
                      reference_model=work.reference_model, grpo=work.grpo,
                      rollout_cache=work.rollout_cache)


@dataclass(frozen=True)
class Budget:
    """GPU memory kept free: ds-config's defaults (10% headroom and 2 GiB for the CUDA context,
    NCCL buffers and fragmentation)."""

    headroom: float = 0.10
    gpu_reserve: int = 2 * 2**30


def check_fit(model: ModelShape, work: Workload, c: Candidate, cluster: Cluster,
              budget: Budget = Budget(), framework: Framework = MDTK) -> Option:
    """The memory model's verdict with ds-config's budget (one fit test for both commands);
    a framework's extra gradient buffer is reserved on top."""
    reserve = budget.gpu_reserve
    if framework.grad_buffer_bytes:
        first, last = stage_params(model, c.tp, c.pp, c.vpp, c.cp, c.ep, c.dp)
        reserve += framework.grad_buffer_bytes * max(first.total, last.total)
    layout = c.layout()
    req = Request(model=model, cluster=cluster,
                  train=train_shape(work, c),
                  layout=layout, stage=str(c.zero), offload=AUTO,
                  headroom=budget.headroom, gpu_reserve=reserve)
    return evaluate(req, zero_for(model, c), layout)


def search(model: ModelShape, work: Workload, cluster: Cluster, device: Device, *,
           top: int = 5, space: SearchSpace = SearchSpace(), framework: Framework = MDTK,
           eff: Efficiency | None = None, group: Callable[[Candidate], tuple] | None = None,
           budget: Budget = Budget()) -> SearchResult:
    """The ``top`` fastest plans that fit, fastest first. ``group`` keeps only the best plan of
    each group (e.g. one per layout); default: one per plan ignoring the micro-batch size."""
    group = group or (lambda c: dataclasses.replace(c, micro_batch=0))
    if dict(space.fixed).get("cp", 1) > 1 and model.cp_refusal:
        raise PlanError(f"cp={dict(space.fixed)['cp']}: {model.cp_refusal} ({model.name}); "
                        "leave cp out or set it to 1.")
    net = Network(device, cluster.gpus_per_node)
    world = cluster.world_size
    costed = []
    for c in candidates(model, work, world, cluster.gpus_per_node, space):
        costed.append((step_cost(model, work, c, net, framework, eff).step, c))
    if not costed:
        raise PlanError(
            f"no layout of {model.name} can use {world} GPUs with global batch "
            f"{work.global_batch} and seq {work.seq_len}: the global batch must be a multiple "
            "of micro_batch x dp, tp must divide the heads, query groups and MLP width, pp the "
            "layers. Try another --global-batch or GPU count.")
    costed.sort(key=lambda tc: (tc[0], _tiebreak(tc[1])))
    plans: list[Planned] = []
    seen: set = set()
    rejected = 0
    reasons: dict[str, str] = {}
    for _, c in costed:
        key = group(c)
        if key in seen:
            continue
        option = check_fit(model, work, c, cluster, budget, framework)
        if not option.fits:
            rejected += 1
            reasons.setdefault(option.reason.split(" (")[0][:40], f"{c.describe()}: "
                               f"{option.reason}")
            continue
        seen.add(key)
        cost = step_cost(model, work, c, net, framework, eff)
        plans.append(Planned(c, cost, option.estimate))
        if len(plans) >= top:
            break
    return SearchResult(tuple(plans), len(costed), rejected, work, cluster,
                        tuple(reasons.values())[:5])


def _tiebreak(c: Candidate) -> tuple:
    """Among equal times prefer less sharding, exact communication (no qwZ/qgZ) and then hpZ
    (the same time with fewer cross-node bytes), no recompute, no offload, smaller models
    parallel sizes: the simpler plan."""
    return (c.tp * c.pp * c.cp, c.zero, c.qwz or c.qgz, -c.hpz, c.offload != "none",
            c.recompute != "none", c.vpp, -c.micro_batch)


def default_global_batch(seq_len: int, world: int, tokens_per_step: int = 2**20) -> int:
    """About ``tokens_per_step`` tokens (1M), rounded up to a multiple of the world size so
    every data-parallel size divides it."""
    return world * max(1, math.ceil(tokens_per_step / seq_len / world))


def explain(best: Planned, other: Planned) -> str:
    """Why ``best`` beats ``other``: how much slower ``other`` is and the two cost terms that
    differ most (``other`` minus ``best``)."""
    a, b = best.cost.breakdown(), other.cost.breakdown()
    diffs = sorted(((b[k] - a[k], k) for k in a), key=lambda d: -abs(d[0]))
    parts = [f"{k.replace('_', ' ')} {d:+.3g} s" for d, k in diffs[:2] if abs(d) > 1e-9]
    slower = other.cost.step / best.cost.step - 1
    text = f"{other.candidate.describe()} is {slower:.1%} slower"
    if parts:
        text += f" ({', '.join(parts)})"
    return text
