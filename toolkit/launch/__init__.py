"""Command lines for running an mdtk command on many ranks: torchrun locally or per node, and
Slurm batch scripts (pure functions returning argv lists / script text), and ``run_local``, which
runs torchrun for this node."""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from toolkit import errors


@dataclass(frozen=True)
class LaunchSpec:
    """Where the ranks run. ``nproc_per_node`` is the number of ranks (GPUs) on each node."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError(
                f"nproc_per_node={self.nproc_per_node}, nnodes={self.nnodes}: both must be >= 1"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, {self.nnodes})")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def torchrun_argv(spec: LaunchSpec, mdtk_args: list[str]) -> list[str]:
    """``python -m torch.distributed.run ... -m toolkit.cli <mdtk_args>`` for this node."""
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={spec.nproc_per_node}", f"--nnodes={spec.nnodes}",
        f"--max-restarts={spec.max_restarts}",
    ]
    if spec.nnodes == 1:
        argv += ["--standalone"] if spec.master_port == 0 else [
            f"--master-addr={spec.master_addr}", f"--master-port={spec.master_port}"]
    else:
        argv += [f"--node-rank={spec.node_rank}", f"--master-addr={spec.master_addr}",
                 f"--master-port={spec.master_port}"]
    return argv + ["-m", "toolkit.cli", *mdtk_args]


def rank_env(spec: LaunchSpec, environ: Mapping[str, str], cores: int | None = None,
             ) -> dict[str, str]:
    """The ranks' environment: ``environ`` with OMP_NUM_THREADS = this node's cores shared by its
    ranks (at least 1) unless already set. torchrun would otherwise set 1 and print a banner
    about it; ``cores`` defaults to the cores this process may run on."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    env = dict(environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // spec.nproc_per_node)))
    return env


def run_local(spec: LaunchSpec, mdtk_args: list[str]) -> int:
    """Run torchrun for this node in this process (``torchrun_argv``'s arguments, ``rank_env``'s
    environment); returns the exit status.

    When every failed rank exited with ``errors.EXIT_STATUS`` (a user error that rank 0 has
    printed as one ``error:`` line), that status comes back without torchrun's own failure
    report (a launcher traceback and a table per rank, which would repeat the error); any other
    failure keeps the report, the ranks' tracebacks above it.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.update(rank_env(spec, os.environ))
    args = torchrun.parse_args(torchrun_argv(spec, mdtk_args)[3:])
    quiet = _DropUserErrorExits()
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    logger.addFilter(quiet)
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        if {f.exitcode for f in e.failures.values()} == {errors.EXIT_STATUS}:
            return errors.EXIT_STATUS
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1
    finally:
        logger.removeFilter(quiet)
    return 0


class _DropUserErrorExits(logging.Filter):
    """torchrun's "failed (exitcode: 2) local_rank: ..." line: the rank said why already."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"(exitcode: {errors.EXIT_STATUS})" not in record.getMessage()


def slurm_script(
    spec: LaunchSpec,
    mdtk_args: list[str],
    *,
    job_name: str = "mdtk",
    partition: str | None = None,
    time_limit: str = "04:00:00",
    venv: str | None = None,
) -> str:
    """An sbatch script: one task per node, each running torchrun for that node's GPUs.

    The first node of the allocation is the rendezvous host; torchrun's c10d rendezvous lets
    nodes start in any order, and a failed node fails the whole job (max_restarts=0 by default),
    which is what checkpoint-and-resume expects.
    """
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={spec.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={spec.nproc_per_node}",
        f"#SBATCH --time={time_limit}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [
        "set -euo pipefail",
        *([f"source {shlex.quote(venv)}/bin/activate"] if venv else []),
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={spec.master_port}",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}",
        "srun --kill-on-bad-exit=1 python -m torch.distributed.run \\",
        f"  --nproc-per-node={spec.nproc_per_node} --nnodes=$SLURM_NNODES \\",
        f"  --max-restarts={spec.max_restarts} \\",
        "  --rdzv-id=$SLURM_JOB_ID --rdzv-backend=c10d \\",
        '  --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \\',
        "  -m toolkit.cli " + " ".join(shlex.quote(a) for a in mdtk_args),
        "",
    ]
    return "\n".join(lines)
