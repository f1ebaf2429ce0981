"""NCCL environment defaults for multi-node runs, per interconnect (InfiniBand or Ethernet).

Each value is a default: a variable the user (or the cluster's module system) already set wins,
and ``describe`` prints which is which so a launch says what it will run with.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

#: For every launch: a failed or timed-out NCCL collective aborts the process (the launcher
#: then restarts or fails the group) instead of leaving the other ranks waiting.
_COMMON = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "WARN"}
#: Several nodes: bootstrap over a real interface (never loopback or container bridges).
_MULTI_NODE = {"NCCL_SOCKET_IFNAME": "^lo,docker,virbr"}
_NETWORK = {
    # GPUDirect RDMA over IB when the topology allows it; IB stays enabled
    "ib": {"NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "PHB"},
    # TCP only: more sockets and threads per connection reach line rate on 25-100 GbE
    "ethernet": {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_NTHREADS": "4",
                 "NCCL_NSOCKS_PERTHREAD": "4"},
}
NETWORKS = ("auto", "ib", "ethernet")


def detect_network(sysfs: Path = Path("/sys/class/infiniband")) -> str:
    """``ib`` when this node has an InfiniBand (or RoCE) device, else ``ethernet``."""
    return "ib" if sysfs.is_dir() and any(sysfs.iterdir()) else "ethernet"


def nccl_defaults(network: str, nnodes: int) -> dict[str, str]:
    """The defaults for ``network`` (``ib``/``ethernet``; ``auto`` detects this node's)."""
    if network not in NETWORKS:
        raise ValueError(f"network={network!r}: choose one of {', '.join(NETWORKS)}")
    if network == "auto":
        network = detect_network()
    out = dict(_COMMON)
    if nnodes > 1:
        out |= _MULTI_NODE | _NETWORK[network]
    return out


def apply(defaults: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with each default added where the variable is not set (the user wins)."""
    return {**defaults, **environ}


def describe(defaults: Mapping[str, str], environ: Mapping[str, str]) -> list[str]:
    """One ``KEY=value (default|yours)`` line per variable, for printing before a launch."""
    return [f"{k}={environ.get(k, v)} ({'yours' if k in environ else 'default'})"
            for k, v in sorted(defaults.items())]
