"""Analytic step time of one training plan (pure functions; docs/planner.md derives each term).

A step is ``m`` micro-batches through ``pp`` pipeline stages followed by the optimizer step:

    step = m * t_stage(slowest) + (pp-1)/vpp * t_stage(mean)        pipeline incl. bubble
         + pipeline sends + exposed DP/ZeRO collectives + optimizer step + offload traffic

``t_stage`` is one micro-batch's forward + backward on one stage: matmul and attention FLOPs at
the device's peak times an achievable efficiency, the elementwise (norm, residual, RoPE,
activation) traffic at the memory bandwidth, and the exposed tensor-, context- and
expert-parallel communication. Collectives cost alpha + bytes / bandwidth with the ring factors
((n-1)/n for all-gather and reduce-scatter, twice that for all-reduce); the bandwidth is the
intra-node link when the group fits in the node's link domain, the network otherwise.

What a framework overlaps differs (DeepSpeed reduces ZeRO-1/2/3 gradients at every micro-batch;
Megatron-LM's distributed optimizer once per step and overlaps its parameter all-gather; TE hides
part of the TP collectives): ``Framework`` holds those switches, ``MDTK`` is mdtk's own.

This module holds the knobs (``Candidate``, ``Workload``, ``Network`` and its ``Link``s), the
result (``StepCost``) and the terms; ``toolkit.planner.step`` composes them into ``step_cost``.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

from toolkit import rules
from toolkit.memory import ModelShape, rank_params
from toolkit.memory.states import RankParams
from toolkit.parallel.layout import ParallelLayout, ResolvedLayout
from toolkit.planner.devices import Device
from toolkit.planner.flops import (
    head_forward_flops,
    layer_elementwise_elements,
    layer_matmul_params,
    model_flops_per_token,
)

OFFLOADS = ("none", "optimizer", "all")
#: Eager attention's passes over the [heads, s, s] scores per forward: the QK^T output written,
#: the scale and causal mask (read + write), softmax (read + write), read by the AV matmul.
EAGER_SCORE_PASSES = 6  # all = optimizer states and ZeRO-3 parameters (cpu)


@dataclass(frozen=True)
class Framework:
    """What the training framework overlaps and how it reduces gradients."""

    name: str
    grad_reduce_per_micro: bool = True  # ZeRO >= 1 reduces at every micro-batch (DeepSpeed)
    grad_reduce_bytes: int | None = None  # bytes per gradient element on the wire (None: dtype)
    tp_overlap: float = 0.0  # fraction of TP collectives hidden behind GEMMs
    param_gather_overlap: bool = False  # ZeRO-1/2 parameter all-gather hidden by next forward
    zero0_overlap: bool = False  # plain DP all-reduce runs during the last backward
    grad_buffer_bytes: int = 0  # a full-size gradient buffer kept besides DeepSpeed's states
    grad_copy_bytes: float = 4.0  # HBM bytes per parameter per micro-batch copying gradients
    #                               into the reduce buffers (read + write 16-bit)


#: mdtk: DeepSpeed engine (ZeRO-1/2/3 reduce every micro-batch; stage 0 after backward; the
#: ZeRO-1/2 parameter all-gather after the step), megatron-core local spec without TE overlap.
MDTK = Framework("mdtk")
#: Megatron-LM as in its README scaling runs: --use-distributed-optimizer --overlap-grad-reduce
#: --overlap-param-gather --tp-comm-overlap (TE userbuffers).
#: Its DDP accumulates gradients in a full fp32 buffer (--accumulate-allreduce-grads-in-fp32, on
#: with bf16) where DeepSpeed's ZeRO-1 keeps a 16-bit 1/N partition: 4 bytes per parameter more.
MEGATRON_LM = Framework("megatron-lm", grad_reduce_per_micro=False, tp_overlap=0.5,
                        param_gather_overlap=True, zero0_overlap=True, grad_buffer_bytes=4,
                        grad_copy_bytes=0.0)
#: (Gradient accumulation fusion writes the wgrad GEMMs straight into that buffer: no copies.)
#: PyTorch FSDP FULL_SHARD (Composer / torchtitan): gathers and reduce-scatters every
#: micro-batch; gradients reduced in fp32 (Composer's DEFAULT and torchtitan's default), so the
#: copy into the flat reduce buffer is followed by a cast to fp32 (2 read + 4 written).
FSDP = Framework("fsdp", grad_reduce_per_micro=True, grad_reduce_bytes=4, grad_copy_bytes=10.0)
FRAMEWORKS = {f.name: f for f in (MDTK, MEGATRON_LM, FSDP)}


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the device's peaks and the fixed costs. ``matmul``,
    ``attention``, ``network`` and ``memory`` are fitted by scripts/calibrate_planner.py on 8
    published runs (docs/planner.md: sources, fit, error on the 16 held-out runs); the others
    are counted or assumed there."""

    matmul: float = 0.725  # GEMM FLOP/s / peak (calibrated)
    attention: float = 0.30  # flash attention, model FLOPs (s x s, not halved) / peak (calibrated)
    network: float = 0.60  # NCCL bus bandwidth / link bandwidth (calibrated)
    memory: float = 0.30  # non-GEMM kernels: achieved / peak HBM bandwidth (calibrated)
    pcie: float = 0.80  # host <-> device copies / PCIe peak
    host: float = 0.50  # CPU Adam: achieved / peak host DRAM bandwidth
    optimizer_bytes: float = 80.0  # HBM bytes per parameter of the GPU optimizer step
    cpu_adam_bytes: float = 30.0  # DRAM bytes per parameter of DeepSpeed's CPU Adam
    logits_bytes: float = 16.0  # bytes per vocabulary entry per token (logits, softmax, grad)


@dataclass(frozen=True)
class Candidate:
    """One plan's knobs. ``vpp`` 1 = not interleaved. ``offload``: none / optimizer (CPU Adam) /
    all (optimizer + ZeRO-3 parameters on the host). ZeRO++ (ZeRO-3 only): ``hpz`` the hpZ
    partition size (1: off), ``qwz`` int8 parameter gathers, ``qgz`` int4 gradient reduction."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    zero: int = 1
    offload: str = "none"
    recompute: str = "none"
    micro_batch: int = 1
    hpz: int = 1
    qwz: bool = False
    qgz: bool = False

    def __post_init__(self) -> None:
        if (self.hpz > 1 or self.qwz or self.qgz) and (
                problem := rules.zeropp_stage_problem(self.zero)):
            raise ValueError(problem)
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload={self.offload!r}: use one of {', '.join(OFFLOADS)}.")
        if (problem := rules.recompute_problem(self.recompute)) is not None:
            raise ValueError(problem)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1  # the planner always pairs tp with sequence parallelism

    def layout(self) -> ResolvedLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, dp=self.dp,
                              vpp=self.vpp if self.vpp > 1 else None,
                              sequence_parallel=self.sequence_parallel).resolve(self.world_size)

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"dp{self.dp}")
        text = " ".join(parts) + f" ZeRO-{self.zero}" + "".join(
            [f"+hpZ{self.hpz}"] * (self.hpz > 1) + ["+qwZ"] * self.qwz + ["+qgZ"] * self.qgz)
        if self.offload != "none":
            text += " +offload(" + ("opt" if self.offload == "optimizer" else "opt+params") + ")"
        if self.recompute != "none":
            text += f" +recompute({self.recompute})"
        return text + f" mb{self.micro_batch}"


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int  # sequences per optimizer step
    dtype: str = "bf16"
    flash: bool = True  # False: eager attention (mdtk's CPU path), scores through memory
    fused: bool = True  # False: megatron-core's unfused kernels (mdtk on CPU; memory model)
    pairs: bool = False  # DPO: a sample is a chosen and a rejected sequence (global_batch pairs)
    reference_model: bool = False  # DPO: a frozen reference runs forward over every micro-batch
    grpo: bool = False  # GRPO: prompt + completion rows (its reference: reference_model)
    rollout_cache: bool = False  # GRPO generating on the ranks: the engine's KV cache

    @property
    def rows(self) -> int:
        """Sequences per sample."""
        return 2 if self.pairs else 1


@dataclass(frozen=True)
class Link:
    """The link a collective runs over: ``gpu link`` (NVLink, inside the link domain), ``pcie``
    (inside a node beyond that domain; also the host link of offload traffic) or ``network``
    (across nodes), with its achieved bus bandwidth (bytes/s) and latency (s)."""

    name: str
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Network:
    """Where the ranks sit: nodes of ``gpus_per_node`` devices."""

    device: Device
    gpus_per_node: int

    def link(self, size: int, stride: int, eff: Efficiency) -> Link:
        """The link of a collective over ``size`` ranks ``stride`` apart.

        Inside a node: the GPU link (PCIe beyond the NVLink domain). Across nodes, NCCL's rings
        run one per rail (NIC): the k group members a node holds push the ring through k NICs
        in parallel, so the bus bandwidth is k x the per-GPU network share, capped by the GPU
        link (k = 1 when the group has one rank per node, e.g. data parallelism across tp=8)."""
        in_domain = min(size * stride, self.gpus_per_node) <= self.device.nvlink_domain
        link = self.device.intra if in_domain else self.device.pcie
        if size * stride <= self.gpus_per_node:
            return Link("gpu link" if in_domain else "pcie", link * eff.network,
                        self.device.latency_intra)
        per_node = min(size, max(1, self.gpus_per_node // stride))
        return Link("network", min(link, per_node * self.device.inter) * eff.network,
                    self.device.latency_inter)

    def bandwidth(self, size: int, stride: int, eff: Efficiency) -> tuple[float, float]:
        """(bus bytes/s, latency) of ``link``."""
        link = self.link(size, stride, eff)
        return link.bandwidth, link.latency


@dataclass(frozen=True)
class StepCost:
    """Seconds per optimizer step, split by cause (exposed time only), and what follows."""

    compute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    pp_bubble: float
    pp_send: float
    dp_comm: float
    buffers: float
    optimizer: float
    offload: float
    step: float
    num_microbatches: int
    tokens_per_s_per_gpu: float
    mfu: float
    reference: float = 0.0  # DPO: the reference model's forward-only pipeline
    volumes: dict[str, float] = field(default_factory=dict)  # bytes per rank per step, by kind
    links: dict[str, str] = field(default_factory=dict)  # the Link.name each kind travels over
    #: What one rank sends per step (ring factors included) over the GPU link / across nodes,
    #: by kind, for the data-parallel collectives (ZeRO-3's split, ZeRO++: planner/zeropp.py).
    sent_intra: dict[str, float] = field(default_factory=dict)
    sent_inter: dict[str, float] = field(default_factory=dict)

    @property
    def cross_node_bytes(self) -> float:
        """Bytes one rank sends across nodes per step in the data-parallel collectives."""
        return sum(self.sent_inter.values())

    def breakdown(self) -> dict[str, float]:
        d = asdict(self)
        return {k: d[k] for k in ("compute", "tp_comm", "cp_comm", "ep_comm", "pp_bubble",
                                  "pp_send", "dp_comm", "buffers", "optimizer", "offload",
                                  "reference")}


# -- the terms, one function each (tests/test_planner_cost.py checks them by hand) ---------------

def ring_time(nbytes: float, n: int, kind: str, bandwidth: float, latency: float) -> float:
    """alpha + ring factor x bytes / bandwidth for one collective over ``n`` ranks. ``kind``:
    allreduce (2(n-1)/n), allgather / reducescatter ((n-1)/n), alltoall ((n-1)/n), p2p (1)."""
    if n <= 1 and kind != "p2p":
        return 0.0
    factor = {"allreduce": 2.0 * (n - 1) / n, "allgather": (n - 1) / n,
              "reducescatter": (n - 1) / n, "alltoall": (n - 1) / n, "p2p": 1.0}[kind]
    return latency + factor * nbytes / bandwidth


def pp_bubble_fraction(pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Idle fraction of the ideal step under 1F1B (interleaved: divided by vpp):
    (pp-1) / (m * vpp)."""
    return (pp - 1) / (num_microbatches * vpp)


def tp_collectives_per_layer(recompute: str, sequence_parallel: bool = False) -> int:
    """All-reduce-sized TP transfers per layer and micro-batch (Megatron's column/row split).
    Without sequence parallelism: forward 2 all-reduces (after attention and after the MLP),
    backward 2 (the input gradients of the two column-parallel linears). With it each becomes an
    all-gather + reduce-scatter of the same bytes, and the backward also re-gathers the two
    column-parallel inputs for their weight gradients (megatron-core's
    ``LinearWithGradAccumulationAndAsyncCommunication``): one all-reduce's worth more. Full
    recompute repeats the forward's 2."""
    return 4 + (1 if sequence_parallel else 0) + (2 if recompute == "full" else 0)


def cp_exchange_bytes(model: ModelShape, tokens: float, cp: int, tp: int, e: int,
                      recompute: str) -> float:
    """Bytes one rank sends per layer per micro-batch in ring attention: the forward passes its
    K and V blocks (tokens x kv_dim / tp each) to the next rank cp-1 times; the backward sends
    K, V and their gradients (twice that); full recompute repeats the forward."""
    if cp <= 1:
        return 0.0
    forward = (cp - 1) * 2 * tokens * model.kv_dim / tp * e
    return forward * (4 if recompute == "full" else 3)


def zero_traffic(zero: int, params: float, n: int, m: int, e_param: int, e_grad: int,
                 per_micro: bool) -> dict[str, float]:
    """Payload bytes of the data-parallel collectives of one step, by kind: gradients
    all-reduced once (ZeRO-0); reduce-scattered per micro-batch (DeepSpeed ZeRO-1/2/3) or once,
    plus the updated parameters all-gathered once (ZeRO-1/2); ZeRO-3 all-gathers the
    parameters for every micro-batch's forward and again for its backward."""
    if n <= 1:
        return {}
    if zero == 0:
        return {"allreduce": params * e_grad}
    reductions = m if per_micro or zero == 3 else 1
    out = {"reducescatter": reductions * params * e_grad}
    out["allgather"] = (2 * m if zero == 3 else 1) * params * e_param
    return out


def offload_bytes(zero: int, offload: str, shard: float, m: int, e: int,
                  e_grad: int) -> tuple[float, float]:
    """(device -> host, host -> device) PCIe bytes of one step for one rank. Optimizer offload:
    the rank's reduced gradient partition goes down every micro-batch (DeepSpeed accumulates it
    in fp32 on the host) and the updated 16-bit partition comes back once. Parameter offload
    (ZeRO-3) also fetches the partition for each micro-batch's forward and backward."""
    if offload == "none":
        return 0.0, 0.0
    reductions = m if zero >= 2 else 1
    down = reductions * shard * e_grad
    up = shard * e
    if offload == "all":
        up += 2 * m * shard * e
    return down, up


def cpu_adam_seconds(shard: float, device: Device, ranks_per_node: int, eff: Efficiency) -> float:
    """DeepSpeed's CPU Adam is DRAM-bound: ``cpu_adam_bytes`` per parameter (fp32 master, m, v
    read and written, the fp32 gradient read, the 16-bit copy written), with the node's memory
    bandwidth shared by its ranks."""
    return shard * eff.cpu_adam_bytes / (device.host_mem * eff.host / ranks_per_node)


# -- cached per-model quantities -----------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def model_terms(model: ModelShape) -> tuple[list[float], list[tuple[float, float]], float]:
    elem = [layer_elementwise_elements(model, i) for i in range(model.layers)]
    return layer_matmul_params(model), elem, head_forward_flops(model)


@functools.lru_cache(maxsize=256)
def model_flops(model: ModelShape, seq_len: int) -> float:
    return model_flops_per_token(model, seq_len)


@functools.lru_cache(maxsize=4096)
def stage_params(model: ModelShape, tp: int, pp: int, vpp: int, cp: int, ep: int, dp: int
                 ) -> tuple[RankParams, RankParams]:
    """This layout's parameters on the first and on the last pipeline stage."""
    layout = ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp if vpp > 1 else None).resolve(
        tp * pp * cp * dp)
    return rank_params(model, layout, 0), rank_params(model, layout, pp - 1)
