"""ZeRO-3's data-parallel traffic, plain and with DeepSpeed's ZeRO++ options, by kind and link.

What DeepSpeed 0.19 does (``runtime/zero/partition_parameters.py``, ``stage3.py``,
``runtime/comm/coalesced_collectives.py``; counted on real engines in tests/test_zeropp.py):

- plain ZeRO-3: every micro-batch gathers the parameters for its forward and again for its
  backward over the data-parallel group, and reduce-scatters the gradients.
- hpZ (``zero_hpz_partition_size`` = h): the first gather after each optimizer step fills a
  secondary copy sharded over h consecutive ranks; every later gather of the step (the backward
  ones and the forwards of micro-batches 2..m) reads it, inside the hpZ group. So one gather per
  step crosses the dp group and 2m - 1 stay in the hpZ group (the paper's per-iteration count
  is m = 1: the backward gather leaves the network).
- qwZ (``zero_quantized_weights``): every gather (forward, backward, secondary) moves int8 plus
  one fp32 scale per group of at most ``QWZ_GROUP`` elements, and dequantizes through fp16.
- qgZ (``zero_quantized_gradients``), only when the world spans several nodes: the gradient
  reduce-scatter becomes an int4 all-to-all inside the node (each rank sends (g-1)/g of its
  gradients), a quantized reduction, and an int4 all-to-all across nodes between the ranks of
  the same local index (each sends (N-1)/N of its 1/g share).

A ring collective over n ranks, k of them in each node, sends (n-1)/n of the payload per rank;
across N = n/k > 1 nodes, N of the ring's n hops leave a node, so 1/k of what a rank sends goes
over the network (the node's k NICs carry its share in parallel) and the rest over NVLink.
Sources: arXiv 2306.10209 (ZeRO++: 3M -> 0.75M cross-node per iteration), docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.planner.cost import Efficiency, Network, ring_time

QWZ_GROUP = 8000  # CUDAQuantizer.target_group_size: one fp32 scale per <= 8000 (4k-16k) elements
SCALE_BYTES = 4  # fp32 quantization scales
INT8, INT4 = 1.0, 0.5  # bytes per element on the wire


@dataclass(frozen=True)
class ZeroPP:
    """The ZeRO++ options of a plan (all off: plain ZeRO-3)."""

    hpz: int = 1
    qwz: bool = False
    qgz: bool = False

    @property
    def on(self) -> bool:
        return self.hpz > 1 or self.qwz or self.qgz

    def describe(self) -> str:
        parts = ([f"hpZ{self.hpz}"] if self.hpz > 1 else []) + (["qwZ"] if self.qwz else []) + (
            ["qgZ"] if self.qgz else [])
        return "+".join(parts)


@dataclass(frozen=True)
class Transfer:
    """One kind of ZeRO-3 collective over one step: calls, the bytes one rank sends over the GPU
    link and over the network, and the seconds before any overlap. ``hides``: behind the
    backward passes (gradient reductions) or any compute (prefetched gathers)."""

    kind: str
    link: str  # the Link.name it runs over
    group: int
    calls: int
    payload: float  # calls x the bytes each collective moves (the volume)
    intra: float
    inter: float
    seconds: float
    hides: str

    @property
    def sent(self) -> float:
        return self.intra + self.inter


def ring_split(sent: float, n: int, per_node: int) -> tuple[float, float]:
    """(intra, inter) share of the ``sent`` bytes of one rank in a ring over ``n`` ranks with
    ``per_node`` of them in each node."""
    if n <= per_node:
        return sent, 0.0
    return sent * (per_node - 1) / per_node, sent / per_node


def gather_bytes(params: float, e: int, qwz: bool) -> float:
    """Payload of one all-gather of ``params`` elements: e bytes each, or qwZ's int8 + scales."""
    return params * (INT8 + SCALE_BYTES / QWZ_GROUP) if qwz else params * e


@dataclass(frozen=True)
class Zero3Group:
    """Where the data-parallel group sits: ``n`` ranks, ``stride`` apart (tp), on nodes of
    ``gpus_per_node``; ``hidden``: the model width (qgZ's quantization group)."""

    net: Network
    eff: Efficiency
    n: int
    stride: int
    hidden: int

    @property
    def per_node(self) -> int:
        return min(self.n, max(1, self.net.gpus_per_node // self.stride))

    @property
    def nodes(self) -> int:
        return -(-self.n // self.per_node)

    def ring(self, kind: str, name: str, payload: float, calls: int, size: int,
             hides: str) -> Transfer:
        """``calls`` ring collectives of ``payload`` bytes over ``size`` consecutive ranks."""
        link = self.net.link(size, self.stride, self.eff)
        per_node = min(size, max(1, self.net.gpus_per_node // self.stride))
        sent = calls * payload * (size - 1) / size
        intra, inter = ring_split(sent, size, per_node)
        seconds = calls * ring_time(payload, size, kind, link.bandwidth, link.latency)
        return Transfer(name, link.name, size, calls, calls * payload, intra, inter, seconds,
                        hides)


def zero3_transfers(g: Zero3Group, params: float, m: int, e: int, e_grad: int,
                    zpp: ZeroPP) -> list[Transfer]:
    """The ZeRO-3 collectives of one optimizer step of ``m`` micro-batches over ``params``
    elements (the rank's model-parallel shard), with the options of ``zpp``."""
    if g.n <= 1:
        return []
    payload = gather_bytes(params, e, zpp.qwz)
    out = []
    if zpp.hpz > 1:
        out.append(g.ring("allgather", "dp_allgather", payload, 1, g.n, "anywhere"))
        out.append(g.ring("allgather", "dp_allgather_hpz", payload, 2 * m - 1, zpp.hpz,
                          "anywhere"))
    else:
        out.append(g.ring("allgather", "dp_allgather", payload, 2 * m, g.n, "anywhere"))
    if zpp.qgz and g.nodes > 1:
        out.append(qgz_transfer(g, params, m))
    else:
        out.append(g.ring("reducescatter", "dp_reducescatter", params * e_grad, m, g.n,
                          "backward"))
    return out


def qgz_transfer(g: Zero3Group, params: float, m: int) -> Transfer:
    """qgZ's two int4 all-to-alls per reduction: inside the node, then across nodes among the
    ranks with the same local index (one NIC each)."""
    k, nodes = g.per_node, g.nodes
    scales = SCALE_BYTES / g.hidden  # one fp32 scale per row of hidden elements
    full = params * (INT4 + scales)
    intra = full * (k - 1) / k
    inter = full / k * (nodes - 1) / nodes
    dev = g.net.device
    gpu_link = g.net.link(k, g.stride, g.eff)
    per_call = (2 * gpu_link.latency + intra / gpu_link.bandwidth
                + 2 * dev.latency_inter + inter / (dev.inter * g.eff.network))
    return Transfer("dp_alltoall_qgz", f"{gpu_link.name}, network", g.n, m, m * full,
                    m * intra, m * inter, m * per_call, "backward")


def kernel_bytes(params: float, m: int, dtype: str, e: int, zpp: ZeroPP, n: int,
                 per_node: int) -> float:
    """HBM bytes of ZeRO++'s quantization kernels in one step. qwZ, per gather (2m): the sender
    quantizes its 1/n partition (reads e, writes 1 byte); the receiver reads the int8 layer and
    writes it as fp16, then casts that to the training dtype (reads 2, writes e; not for fp16).
    qgZ, per reduction (m): quantize (read e, write 0.5), reduce what arrived (read 0.5, write
    0.5/k), dequantize the result (read 0.5/k, write e/k)."""
    total = 0.0
    if zpp.qwz:
        receive = INT8 + 2 + (0 if dtype == "fp16" else 2 + e)
        total += 2 * m * params * ((e + INT8) / n + receive)
    if zpp.qgz:
        total += m * params * (e + 2 * INT4 + (2 * INT4 + e) / per_node)
    return total


KIND_LABELS = {
    "dp_allreduce": "gradient all-reduce",
    "dp_allgather": "parameter all-gather (dp group)",
    "dp_allgather_hpz": "parameter all-gather (hpZ group)",
    "dp_reducescatter": "gradient reduce-scatter",
    "dp_alltoall_qgz": "gradient all-to-alls (qgZ, int4)",
}


def traffic_rows(costs: dict[str, object]) -> list[tuple[str, list[tuple[float, float]]]]:
    """The data-parallel traffic of several plans side by side (``StepCost`` by name): one row
    per kind, ``(GPU link, network)`` bytes one rank sends per step for each plan, then the
    total."""
    plans = list(costs.values())
    kinds = [k for k in KIND_LABELS if any(k in c.sent_intra for c in plans)]
    rows = [(KIND_LABELS[k], [(c.sent_intra.get(k, 0.0), c.sent_inter.get(k, 0.0))
                              for c in plans]) for k in kinds]
    rows.append(("total", [(sum(c.sent_intra.values()), sum(c.sent_inter.values()))
                           for c in plans]))
    return rows
