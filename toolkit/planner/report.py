"""``mdtk plan`` as library calls: the request as the command line gives it (``PlanRequest``),
resolved once (device, model shape, cluster, token count: ``Setting``) and answered with a
search (``plan_layouts`` -> ``PlanReport``) or a sweep over GPU counts (``sweep_gpus`` ->
``SweepReport``), each with the dict ``--json`` prints. Errors are ``ValueError``s whose message
is the one line the command prints."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.lora import LoraSpec
from toolkit.memory import (
    GIB,
    Cluster,
    ModelShape,
    dpo_fields,
    load_model_shape,
    parse_bytes,
    vllm_reserve,
)
from toolkit.planner.cost import Network, StepCost, Workload
from toolkit.planner.devices import Device, get_device, network_inter
from toolkit.planner.search import (
    Budget,
    PlanError,
    SearchResult,
    SearchSpace,
    default_global_batch,
    layout_key,
    search,
)
from toolkit.planner.step import step_cost
from toolkit.planner.sweep import SweepRow, figure, marks, sweep, sweep_global_batch

_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str | None) -> float | None:
    """'2T', '300B', '1.5e12' -> tokens (decimal suffixes)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMBGT]?)\s*", text.upper())
    if not m:
        raise ValueError(f"cannot read the token count {text!r}: write it like 2T, 300B or 1e12.")
    return float(m.group(1)) * _SCALE[m.group(2)]


@dataclass(frozen=True)
class PlanRequest:
    """The question of ``mdtk plan``, as its options give it (sizes and counts as text)."""

    model: str
    tokens: str | None = None  # e.g. 2T: time and cost columns
    price: float | None = None  # of one GPU-hour
    gpu: str = "h100"
    gpu_mem: str | None = None  # default: the device's
    nodes: int = 1
    gpus_per_node: int = 8
    cpu_mem: str = "1TB"
    seq_len: int = 4096
    global_batch: int | None = None  # default: ~1M tokens, a multiple of the GPUs
    dtype: str = "bf16"
    flash: bool = True
    top: int = 5
    allow_cp: bool = False
    network: str = "ib"  # devices.NETWORKS; an "inter" device override wins
    allow_quantized: bool = False  # ZeRO++'s lossy qwZ / qgZ may be ranked too
    per_layout: bool = False
    emit_rank: int = 1  # the search keeps at least this many plans
    dpo: bool = False  # preference pairs (2 sequences a sample) with a reference model ...
    precompute_reference: bool = False  # ... unless its log-probabilities are precomputed
    grpo: bool = False  # online RL: the generation engine's KV cache on every rank ...
    grpo_reference: bool = False  # ... and, with grpo.beta > 0, a frozen reference model
    grpo_vllm: float | None = None  # rollouts from vLLM instead: its share of each GPU
    device_overrides: dict[str, float | None] = field(default_factory=dict)  # get_device's
    lora: LoraSpec | None = None  # train adapters only (--peft)


@dataclass(frozen=True)
class Setting:
    """A request resolved: what the search and the sweep run on."""

    shape: ModelShape
    device: Device
    cluster: Cluster
    tokens: float | None
    kernels: dict[str, bool]  # Workload's flash / fused / pairs / reference_model / grpo ...
    space: SearchSpace
    budget: Budget
    vllm_share: float | None = None  # --grpo-vllm: vLLM's share of each GPU (kept in budget)


def resolve(req: PlanRequest) -> Setting:
    dpo = dpo_fields(req.dpo, req.precompute_reference)
    overrides = dict(req.device_overrides)
    if overrides.get("inter") is None:
        overrides["inter"] = network_inter(req.network, req.gpus_per_node)
    device = get_device(req.gpu, **overrides)
    shape = load_model_shape(req.model, lora=req.lora)
    count = parse_count(req.tokens)
    gpu_mem = parse_bytes(req.gpu_mem) if req.gpu_mem else int(device.memory_gib * GIB)
    cluster = Cluster(nodes=req.nodes, gpus_per_node=req.gpus_per_node, gpu_mem=gpu_mem,
                      cpu_mem=parse_bytes(req.cpu_mem))
    on_cpu = device.key == "cpu"  # mdtk's CPU path: megatron-core's unfused kernels, eager
    if req.grpo and req.dpo:
        raise ValueError("--grpo and --dpo: a run trains one objective; choose one.")
    if req.grpo_reference and not req.grpo:
        raise ValueError("--grpo-reference applies to --grpo (grpo.beta > 0).")
    if req.grpo_vllm is not None and not (req.grpo and 0 < req.grpo_vllm <= 1):
        raise ValueError(f"--grpo-vllm {req.grpo_vllm}: give it with --grpo, a share of each "
                         "GPU in (0, 1] (grpo.vllm_gpu_memory_utilization, e.g. 0.3).")
    grpo = {"grpo": True, "rollout_cache": req.grpo_vllm is None,
            "reference_model": req.grpo_reference} if req.grpo else {}
    kernels = {"flash": not on_cpu and req.flash, "fused": not on_cpu, **dpo, **grpo}
    budget = Budget()
    if req.grpo_vllm is not None:  # vLLM's share of the device stays free, as the trainer does
        budget = Budget(gpu_reserve=budget.gpu_reserve + vllm_reserve(req.grpo_vllm, gpu_mem))
    return Setting(shape, device, cluster, count, kernels,
                   SearchSpace(allow_cp=req.allow_cp, allow_quantized=req.allow_quantized),
                   budget, req.grpo_vllm)


@dataclass(frozen=True)
class PlanReport:
    """The ranked plans of one cluster."""

    setting: Setting
    work: Workload
    result: SearchResult
    price: float | None

    def to_dict(self) -> dict[str, Any]:
        s, work, result, tokens = self.setting, self.work, self.result, self.setting.tokens
        return {
            "model": s.shape.name, "params": s.shape.num_params(), "device": s.device.key,
            "nodes": s.cluster.nodes, "gpus_per_node": s.cluster.gpus_per_node,
            "seq_len": work.seq_len, "global_batch": work.global_batch, "dtype": work.dtype,
            "tokens": tokens, "price_per_gpu_hour": self.price,
            "considered": result.considered, "rejected_memory": result.rejected_memory,
            "plans": [p.to_dict(tokens, self.price) for p in result.plans],
        }


def traffic_comparison(report: PlanReport, rank: int = 1) -> dict[str, StepCost]:
    """The data-parallel traffic of plan ``rank`` beside the same plan without ZeRO++ (empty
    when the plan has no ZeRO++ option)."""
    plan = report.result.plans[rank - 1]
    c, s = plan.candidate, report.setting
    if not (c.hpz > 1 or c.qwz or c.qgz):
        return {}
    plain = dataclasses.replace(c, hpz=1, qwz=False, qgz=False)
    net = Network(s.device, s.cluster.gpus_per_node)
    return {"plain ZeRO-3": step_cost(s.shape, report.work, plain, net),
            f"#{rank}": plan.cost}


def plan_layouts(req: PlanRequest) -> PlanReport:
    """The fastest plans that fit; PlanError naming examples of what did not, when none does."""
    s = resolve(req)
    work = Workload(req.seq_len, req.global_batch or default_global_batch(
        req.seq_len, s.cluster.world_size), req.dtype, **s.kernels)
    result = search(s.shape, work, s.cluster, s.device, top=max(req.top, req.emit_rank),
                    space=s.space, budget=s.budget, group=layout_key if req.per_layout else None)
    if not result.plans:
        raise PlanError(
            f"no plan of {s.shape.name} fits {s.cluster.world_size} x "
            f"{s.cluster.gpu_mem / GIB:.0f} GiB (global batch {work.global_batch}, seq "
            f"{req.seq_len}); for example:\n  " + "\n  ".join(result.reasons) + "\nTry more "
            "GPUs, a shorter --seq-len or a GPU with more memory.")
    return PlanReport(s, work, result, req.price)


@dataclass(frozen=True)
class SweepReport:
    """The best plan of each GPU count and its time and cost for the request's tokens."""

    setting: Setting
    work: Workload
    rows: list[SweepRow]
    price: float | None

    @property
    def tokens(self) -> float:
        return float(self.setting.tokens or 0)

    @property
    def unit(self) -> str:
        return "cost" if self.price is not None else "GPU-hours"

    def to_dict(self) -> dict[str, Any]:
        s, tokens, price = self.setting, self.setting.tokens, self.price
        fastest, cheapest = marks(self.rows)
        return {
            "model": s.shape.name, "device": s.device.key, "seq_len": self.work.seq_len,
            "global_batch": self.work.global_batch, "tokens": tokens,
            "price_per_gpu_hour": price, "fastest_gpus": fastest, "cheapest_gpus": cheapest,
            "rows": [{"gpus": r.gpus, "hours": r.hours,
                      self.unit.replace("-", "_").lower(): r.cost,
                      "plan": r.plan.to_dict(tokens, price) if r.plan else None,
                      "reason": r.reason or None} for r in self.rows]}

    def title(self) -> str:
        return f"{self.setting.shape.name}: {self.tokens:.3g} tokens on {self.setting.device.key}"

    def save_figure(self, path: Path) -> None:
        """The plot as a PNG (ImportError without matplotlib)."""
        import io

        from toolkit.atomic import write_bytes

        fig = figure(self.rows, self.title(), self.price is not None)
        png = io.BytesIO()
        fig.savefig(png, format="png")
        write_bytes(path, png.getvalue())


def sweep_gpus(req: PlanRequest, counts_text: str) -> SweepReport:
    """``--sweep-gpus 8,16,32``: the best plan per GPU count (one global batch for all)."""
    s = resolve(req)
    counts = _counts(counts_text)
    if not s.tokens:
        raise ValueError("--sweep-gpus needs --tokens (the time and cost to train that many "
                         "tokens).")
    work = Workload(req.seq_len, req.global_batch or sweep_global_batch(req.seq_len, counts),
                    req.dtype, **s.kernels)
    rows = sweep(s.shape, work, counts, s.cluster, s.device, s.tokens, req.price, s.space,
                 s.budget)
    return SweepReport(s, work, rows, req.price)


def _counts(text: str) -> Sequence[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--sweep-gpus {text!r}: give GPU counts like 8,16,32,64.") from None
    if not counts or min(counts) < 1:
        raise ValueError("--sweep-gpus needs positive GPU counts, e.g. 8,16,32,64.")
    return counts
