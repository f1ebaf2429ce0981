"""The DeepSpeed launcher: a hostfile (``host slots=N`` lines) and the ``deepspeed`` command
line that runs an mdtk command on the hosts it names.

One host runs locally (no ssh); several hosts are reached by DeepSpeed through pdsh/ssh from
the node where the command runs, as DeepSpeed always does.
"""

from __future__ import annotations

import sys
from pathlib import Path

from toolkit.errors import UserError
from toolkit.launch import LaunchSpec


class HostfileError(UserError):
    """A hostfile that does not match the asked shape; the message names both."""


def hostfile_text(hosts: list[str], slots: int) -> str:
    return "".join(f"{h} slots={slots}\n" for h in hosts)


def read_hostfile(path: Path) -> dict[str, int]:
    """{host: slots} of a DeepSpeed hostfile (comments and blank lines skipped)."""
    hosts: dict[str, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:
            slots = int(parts[1].removeprefix("slots=")) if len(parts) > 1 else -1
        except ValueError:
            slots = -1
        if len(parts) != 2 or not parts[1].startswith("slots=") or slots < 1:
            raise HostfileError(f"{path}:{n}: {line!r} is not 'HOST slots=N'.")
        hosts[parts[0]] = slots
    return hosts


def check_hostfile(hosts: dict[str, int], spec: LaunchSpec, path: Path) -> None:
    """The hostfile must hold at least ``nnodes`` hosts of ``nproc_per_node`` slots each."""
    short = {h: s for h, s in hosts.items() if s < spec.nproc_per_node}
    if len(hosts) < spec.nnodes or short:
        raise HostfileError(
            f"{path} lists {len(hosts)} host(s) {dict(hosts)}; --nodes {spec.nnodes} "
            f"--gpus-per-node {spec.nproc_per_node} needs {spec.nnodes} host(s) with at least "
            f"{spec.nproc_per_node} slots each.")


def deepspeed_argv(spec: LaunchSpec, hostfile: Path, mdtk_args: list[str], *,
                   executable: list[str] | None = None) -> list[str]:
    """``deepspeed --hostfile F ... --module toolkit.cli <mdtk_args>``; ``executable`` defaults
    to this Python's runner module (the ``deepspeed`` script need not be on PATH)."""
    exe = executable or [sys.executable, "-m", "deepspeed.launcher.runner"]
    return [*exe, f"--hostfile={hostfile}", f"--num_nodes={spec.nnodes}",
            f"--num_gpus={spec.nproc_per_node}", f"--master_addr={spec.master_addr}",
            f"--master_port={spec.master_port}",
            # mdtk reads LOCAL_RANK from the environment: no --local_rank argument; the
            # single-host case runs locally and needs no ssh
            "--no_local_rank", "--no_ssh_check", "--module", "toolkit.cli", *mdtk_args]
