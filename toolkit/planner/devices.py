"""Accelerators the planner knows: peak FLOP/s, memory, and the links a training step uses.

Every figure is a vendor datasheet value (dense, no sparsity) unless ``assumed`` names it; the
sources are listed per device in docs/planner.md. Bandwidths are per GPU and per direction in
bytes/s: ``intra`` is the GPU-to-GPU link inside a node (NVLink / Infinity Fabric, or PCIe where
there is none), ``inter`` the GPU's share of the node's network (one NIC per GPU on DGX/HGX
systems), ``pcie`` the host link used by offload, ``host_mem`` the node's CPU memory bandwidth
(the CPU Adam step is bound by it).

The same table gives the trainer its MFU peak (``peak_tflops`` matches CUDA device names).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolkit.errors import UserError

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Device:
    """One accelerator model and the node it usually sits in."""

    key: str
    name: str
    bf16_tflops: float  # dense BF16 tensor-core peak
    fp32_tflops: float  # plain FP32 (torch does not use TF32 for matmuls by default)
    memory_gib: float  # usable HBM of one device (the datasheet GB, as GiB the driver reports)
    hbm: float  # memory bandwidth, bytes/s
    intra: float  # GPU <-> GPU inside the node, bytes/s per direction
    inter: float  # per-GPU share of the node's network, bytes/s per direction
    pcie: float  # GPU <-> host, bytes/s per direction
    host_mem: float  # node CPU memory bandwidth, bytes/s (CPU Adam)
    nvlink_domain: int = 8  # GPUs that share the fast ``intra`` link; larger groups use PCIe
    latency_intra: float = 10e-6  # seconds per collective inside a node (NCCL, assumed)
    latency_inter: float = 30e-6  # seconds per collective across nodes (NCCL, assumed)
    cuda_names: tuple[str, ...] = ()  # words of the CUDA device name that identify it
    assumed: tuple[str, ...] = ()  # fields that are not datasheet values (see docs/planner.md)

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for training in ``dtype`` (bf16/fp16 use the tensor cores)."""
        return (self.fp32_tflops if dtype == "fp32" else self.bf16_tflops) * 1e12


def _pcie(gen: int) -> float:
    """x16 link, per direction: 2 GB/s per lane at Gen4 (16 GT/s, 128b/130b), 4 at Gen5."""
    return {4: 32 * GB, 5: 64 * GB}[gen]


def _ddr(channels: int, mt_s: int, sockets: int = 2) -> float:
    """Peak DRAM bandwidth: channels x transfers/s x 8 bytes, per node."""
    return channels * mt_s * 1e6 * 8 * sockets


NDR = 400e9 / 8  # ConnectX-7 InfiniBand NDR, 400 Gb/s per GPU
HDR = 200e9 / 8  # ConnectX-6 InfiniBand HDR, 200 Gb/s per GPU
_SPR = _ddr(8, 4800)  # 2 x Xeon Platinum 8480C (DGX H100 / H200): 8 x DDR5-4800 per socket
_EMR = _ddr(8, 5600)  # 2 x Xeon Platinum 8570 (DGX B200): 8 x DDR5-5600 per socket
_ROME = _ddr(8, 3200)  # 2 x EPYC 7742 (DGX A100): 8 x DDR4-3200 per socket

DEVICES: dict[str, Device] = {d.key: d for d in (
    Device("h100", "NVIDIA H100 SXM5 80GB", 989.0, 67.0, 80, 3.35 * TB, 450 * GB, NDR,
           _pcie(5), _SPR, cuda_names=("H100",)),
    Device("h100-pcie", "NVIDIA H100 PCIe 80GB", 756.0, 51.0, 80, 2.0 * TB, _pcie(5), NDR,
           _pcie(5), _SPR, nvlink_domain=1, cuda_names=("H100", "PCIE"),
           assumed=("inter", "host_mem")),
    Device("h100-nvl", "NVIDIA H100 NVL 94GB", 835.0, 60.0, 94, 3.9 * TB, 300 * GB, NDR,
           _pcie(5), _SPR, nvlink_domain=2, cuda_names=("H100", "NVL"),
           assumed=("inter", "host_mem")),
    Device("h200", "NVIDIA H200 SXM 141GB", 989.0, 67.0, 141, 4.8 * TB, 450 * GB, NDR,
           _pcie(5), _SPR, cuda_names=("H200",)),
    Device("h200-nvl", "NVIDIA H200 NVL 141GB", 835.0, 60.0, 141, 4.8 * TB, 450 * GB, NDR,
           _pcie(5), _SPR, nvlink_domain=4, cuda_names=("H200", "NVL"),
           assumed=("inter", "host_mem")),
    # GH200: one GPU per superchip (--gpus-per-node 1); NVLink-C2C (900 GB/s both ways) is its
    # host link
    Device("gh200", "NVIDIA GH200 96GB", 989.0, 67.0, 96, 4.0 * TB, 450 * GB, NDR,
           450 * GB, 512 * GB, nvlink_domain=1, cuda_names=("GH200",)),
    Device("h800", "NVIDIA H800 SXM5 80GB", 989.0, 67.0, 80, 3.35 * TB, 200 * GB, NDR,
           _pcie(5), _SPR, cuda_names=("H800",), assumed=("inter", "host_mem")),
    Device("b200", "NVIDIA B200 (HGX/DGX B200) 180GB", 2250.0, 75.0, 180, 8.0 * TB, 900 * GB,
           NDR, _pcie(5), _EMR, cuda_names=("B200",)),
    Device("a100-80gb", "NVIDIA A100 SXM4 80GB", 312.0, 19.5, 80, 2.039 * TB, 300 * GB, HDR,
           _pcie(4), _ROME, cuda_names=("A100",)),
    Device("a100-40gb", "NVIDIA A100 SXM4 40GB", 312.0, 19.5, 40, 1.555 * TB, 300 * GB, HDR,
           _pcie(4), _ROME, cuda_names=("A100",)),
    Device("a800", "NVIDIA A800 SXM4 80GB", 312.0, 19.5, 80, 2.039 * TB, 200 * GB, HDR,
           _pcie(4), _ROME, cuda_names=("A800",), assumed=("inter", "host_mem")),
    Device("l40s", "NVIDIA L40S 48GB", 362.0, 91.6, 48, 864 * GB, _pcie(4), HDR, _pcie(4), _SPR,
           nvlink_domain=1, cuda_names=("L40S",), assumed=("inter", "host_mem")),
    Device("l40", "NVIDIA L40 48GB", 181.0, 90.5, 48, 864 * GB, _pcie(4), HDR, _pcie(4), _SPR,
           nvlink_domain=1, cuda_names=("L40",), assumed=("inter", "host_mem")),
    Device("l4", "NVIDIA L4 24GB", 121.0, 30.3, 24, 300 * GB, _pcie(4), HDR, _pcie(4), _SPR,
           nvlink_domain=1, cuda_names=("L4",), assumed=("inter", "host_mem")),
    Device("a10", "NVIDIA A10 24GB", 125.0, 31.2, 24, 600 * GB, _pcie(4), HDR, _pcie(4), _SPR,
           nvlink_domain=1, cuda_names=("A10",), assumed=("inter", "host_mem")),
    Device("mi300x", "AMD Instinct MI300X 192GB", 1307.0, 163.4, 192, 5.3 * TB, 448 * GB, NDR,
           _pcie(5), _SPR, cuda_names=("MI300X",), assumed=("inter", "host_mem")),
    Device("mi250x", "AMD Instinct MI250X 128GB", 383.0, 47.9, 128, 3.2 * TB, 200 * GB, HDR,
           _pcie(4), _ROME, cuda_names=("MI250X",),
           assumed=("intra", "inter", "host_mem")),
    # One x86 core per rank (mdtk's CPU mode on gloo): AVX2, 2 FMA units x 8 fp32 lanes x 2 FLOP
    # x 3 GHz = 96 GFLOP/s; loopback "links". scripts/bench_planner.py measures the machine.
    Device("cpu", "x86 CPU core (gloo ranks)", 0.096, 0.096, 4, 20 * GB, 2 * GB, 2 * GB,
           20 * GB, 20 * GB, nvlink_domain=1, latency_intra=200e-6,
           latency_inter=200e-6,
           assumed=("bf16_tflops", "fp32_tflops", "memory_gib", "hbm", "intra", "inter",
                    "pcie", "host_mem", "latency_intra", "latency_inter")),
)}

# CUDA/ROCm name -> device for the trainer's MFU: the first entry whose words are all words of
# the name wins, so the two-word names come first ("H100 PCIe" before "H100"). A100 40/80 GB
# share one peak; GH200 is matched before H200 by its own word.
_NAME_ORDER = ("gh200", "h200-nvl", "h100-nvl", "h100-pcie", "h200", "h100", "h800", "b200",
               "a100-80gb", "a800", "l40s", "l40", "l4", "a10", "mi300x", "mi250x")


class DeviceError(UserError):
    """An unknown device or an impossible override; the message lists the known ones."""


#: ``--network``: the inter-node network per node, bytes/s per direction; None = the device
#: table's own (DGX/HGX-style: one 400 Gb/s InfiniBand NDR NIC per GPU; HDR for A100).
#: ``ethernet`` is one 100 GbE port per node shared by its GPUs (assumed: a commodity or cloud
#: node without a rail of NICs; --inter-gbps gives any other figure).
NETWORKS: dict[str, float | None] = {"ib": None, "ethernet": 100e9 / 8}


def network_inter(network: str, gpus_per_node: int) -> float | None:
    """The per-GPU network share of ``network`` (None: the device's own)."""
    if network not in NETWORKS:
        raise DeviceError(f"--network {network!r}: use one of {', '.join(NETWORKS)} (or give "
                          "--inter-gbps).")
    per_node = NETWORKS[network]
    return None if per_node is None else per_node / gpus_per_node


def get_device(key: str, **overrides: float | int | None) -> Device:
    """A device from the table, with any field replaced (``--peak-tflops`` and friends)."""
    d = DEVICES.get(key.lower())
    if d is None:
        raise DeviceError(f"unknown device {key!r}: choose one of {', '.join(DEVICES)} (or "
                          "override its numbers with --peak-tflops, --intra-gbps, ...).")
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(given) - {f.name for f in dataclasses.fields(Device)}
    if unknown:
        raise DeviceError(f"device fields {sorted(unknown)} do not exist.")
    for k, v in given.items():
        if isinstance(v, (int, float)) and v <= 0:
            raise DeviceError(f"device override {k}={v} must be positive.")
    return dataclasses.replace(d, **given)


def device_for_name(device_name: str | None) -> Device | None:
    """The table entry of a CUDA/ROCm device name, None for CPUs and unknown names."""
    if not device_name:
        return None
    words = set(device_name.upper().replace("-", " ").split())
    for key in _NAME_ORDER:
        if set(DEVICES[key].cuda_names) <= words:
            return DEVICES[key]
    return None


def peak_tflops(device_name: str | None, override: float | None = None) -> float | None:
    """Peak dense BF16 TFLOP/s of a device; ``override`` wins; None for CPUs and unknown names."""
    if override is not None:
        return float(override)
    device = device_for_name(device_name)
    return device.bf16_tflops if device else None
