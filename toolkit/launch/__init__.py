"""Command lines for running an mdtk command on many ranks: torchrun locally or per node, Slurm
batch scripts and the DeepSpeed launcher (pure functions returning argv lists / script text), and
``run_local``, which runs torchrun for this node.

Multi-node and restartable launches use torchrun's c10d rendezvous: agents may start in any
order, and after a failure the group re-forms and the trainer resumes from its latest complete
checkpoint (``checkpoint.resume: auto``). See docs/training.md, "Running on a cluster".
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from toolkit import errors
from toolkit.train.loop.faults import STOP_FILE_ENV


@dataclass(frozen=True)
class LaunchSpec:
    """Where the ranks run. ``nproc_per_node`` is the number of ranks (GPUs) on each node."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0
    rdzv_id: str = "mdtk"

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError(
                f"nproc_per_node={self.nproc_per_node}, nnodes={self.nnodes}: both must be >= 1"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, {self.nnodes})")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= 0")

    @property
    def elastic(self) -> bool:
        """Whether torchrun needs the c10d rendezvous: several nodes, or restarts (a restarted
        group re-forms through it)."""
        return self.nnodes > 1 or self.max_restarts > 0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def torchrun_argv(spec: LaunchSpec, mdtk_args: list[str]) -> list[str]:
    """``python -m torch.distributed.run ... -m toolkit.cli <mdtk_args>`` for this node.

    One node without restarts: a static rendezvous (``--standalone`` for port 0). Otherwise
    c10d on ``master_addr:master_port``; node 0's agent hosts the store (``is_host``), so
    agents on one machine (tests) or behind aliased host names agree on who serves it."""
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={spec.nproc_per_node}", f"--nnodes={spec.nnodes}",
        f"--max-restarts={spec.max_restarts}",
    ]
    if not spec.elastic:
        argv += ["--standalone"] if spec.master_port == 0 else [
            f"--master-addr={spec.master_addr}", f"--master-port={spec.master_port}"]
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={spec.master_addr}:{spec.master_port}",
                 f"--rdzv-id={spec.rdzv_id}"]
        if spec.nnodes > 1:
            argv += [f"--node-rank={spec.node_rank}",
                     f"--rdzv-conf=is_host={str(spec.node_rank == 0).lower()}"]
    return argv + ["-m", "toolkit.cli", *mdtk_args]


def rank_env(spec: LaunchSpec, environ: Mapping[str, str], cores: int | None = None,
             ) -> dict[str, str]:
    """The ranks' environment: ``environ`` with OMP_NUM_THREADS = this node's cores shared by its
    ranks (at least 1) unless already set. torchrun would otherwise set 1 and print a banner
    about it; ``cores`` defaults to the cores this process may run on."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    env = {**elastic_env(spec), **environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // spec.nproc_per_node)))
    return env


def elastic_env(spec: LaunchSpec) -> dict[str, str]:
    """Defaults for c10d launches: a fresh TCP store for the ranks of every attempt. torch
    shares the agent's rendezvous store with the ranks and keeps it across restarts, so a
    restarted group would read the previous attempt's addresses (gloo "connectFullMesh ...
    Connection refused") and fail every restart."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if spec.elastic else {}


def run_local(spec: LaunchSpec, mdtk_args: list[str]) -> int:
    """Run torchrun for this node in this process (``torchrun_argv``'s arguments, ``rank_env``'s
    environment); returns the exit status.

    When every failed rank exited with ``errors.EXIT_STATUS`` (a user error that rank 0 has
    printed as one ``error:`` line), that status comes back without torchrun's own failure
    report (a launcher traceback and a table per rank, which would repeat the error); any other
    failure keeps the report, the ranks' tracebacks above it. A signal to this process
    (SIGTERM: a Kubernetes pod or Slurm job ending) is forwarded to the ranks by torchrun,
    which waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30 s) for them to save and exit; the
    status is then 128 + the signal, without a traceback.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.update(rank_env(spec, os.environ))
    args = torchrun.parse_args(torchrun_argv(spec, mdtk_args)[3:])
    quiet = _DropUserErrorExits()
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    logger.addFilter(quiet)
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if codes == {errors.EXIT_STATUS}:
            return errors.EXIT_STATUS
        if codes == {errors.EXIT_STOPPED}:  # the ranks said where they saved
            return errors.EXIT_STOPPED
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        print(f"[mdtk launch] {e.sigval.name}: the ranks were asked to save and stop",
              file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        logger.removeFilter(quiet)
    return 0


class _DropUserErrorExits(logging.Filter):
    """torchrun's "failed (exitcode: 2) local_rank: ..." line: the rank said why already."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return all(f"(exitcode: {code})" not in message
                   for code in (errors.EXIT_STATUS, errors.EXIT_STOPPED))


def slurm_script(
    spec: LaunchSpec,
    mdtk_args: list[str],
    *,
    job_name: str = "mdtk",
    partition: str | None = None,
    time_limit: str = "04:00:00",
    venv: str | None = None,
    log_dir: str = "logs",
    stop_file: str | None = None,
    stop_minutes: int = 10,
    env: Mapping[str, str] | None = None,
) -> str:
    """An sbatch script: one task per node, each running torchrun for that node's GPUs.

    The first node of the allocation is the c10d rendezvous host; nodes may start in any order.
    Preemption and time limits: ``--signal=B:USR1@<stop_minutes*60>`` reaches the batch shell
    before the limit; its trap creates ``stop_file`` (exported as ``MDTK_STOP_FILE``), every
    rank sees it at the next step boundary, saves a checkpoint and exits with
    ``errors.EXIT_STOPPED``; the script then requeues the job (``--requeue``), whose trainer
    resumes from that checkpoint (``checkpoint.resume: auto``). ``env``: exported defaults
    (NCCL settings), each kept when the job's environment already sets it.
    """
    stop = stop_file or "${SLURM_SUBMIT_DIR}/.mdtk-stop-${SLURM_JOB_ID}"
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={spec.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={spec.nproc_per_node}",
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={log_dir}/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{stop_minutes * 60}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [
        "set -uo pipefail",
        *([f"source {shlex.quote(venv)}/bin/activate"] if venv else []),
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={spec.master_port}",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}",
        *(f"export {k}=${{{k}:-{shlex.quote(v)}}}" for k, v in sorted((env or {}).items())),
        f'export {STOP_FILE_ENV}="{stop}"',
        f'rm -f "${STOP_FILE_ENV}"  # a stop asked of an earlier run of this job is done',
        "STOPPING=0",
        "on_usr1() {",
        '  echo "[mdtk] time limit or preemption near: asking the ranks to save and stop"',
        f'  STOPPING=1; touch "${STOP_FILE_ENV}"',
        "}",
        "trap on_usr1 USR1",
        f'echo "[mdtk] job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}): {spec.nnodes} '
        f'nodes x {spec.nproc_per_node} GPUs, rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "srun --kill-on-bad-exit=1 python -m torch.distributed.run \\",
        f"  --nproc-per-node={spec.nproc_per_node} --nnodes=$SLURM_NNODES \\",
        f"  --max-restarts={spec.max_restarts} \\",
        "  --rdzv-id=$SLURM_JOB_ID --rdzv-backend=c10d \\",
        '  --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" \\',
        "  -m toolkit.cli " + " ".join(shlex.quote(a) for a in mdtk_args) + " &",
        "SRUN_PID=$!",
        "# wait returns early when the trap runs: wait again until srun has ended",
        'while wait "$SRUN_PID"; STATUS=$?; kill -0 "$SRUN_PID" 2>/dev/null; do :; done',
        'if [ "$STOPPING" = 1 ]; then',
        '  echo "[mdtk] ranks stopped with status $STATUS; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$STATUS"',
        "",
    ]
    return "\n".join(lines)
