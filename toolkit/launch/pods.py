"""Where this pod stands in its job, read from what the Kubernetes controllers put into the pod
(``mdtk launch ... --in-pod``), as ``toolkit.runtime`` reads ``SLURM_*`` under srun:

* Kubeflow TrainJob (the Trainer's torch plugin): ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK`` (the pod's completion index), ``PET_MASTER_ADDR`` (``<job>-node-0-0.<job>``)
  and ``PET_MASTER_PORT``;
* JobSet (an Indexed Job per replicated job): ``JOB_COMPLETION_INDEX`` (set by the Job
  controller) is the node rank; ``MASTER_ADDR``/``MASTER_PORT`` (the first pod's DNS name under
  the headless service) come from the manifest mdtk wrote;
* both: ``JOBSET_RESTART_ATTEMPT`` (the manifest maps JobSet's restart-attempt annotation into
  it), which names the attempt's rendezvous.

The numbers the pod was started with (``--nodes``, ``--gpus-per-node``) must agree with the
controller's: a TrainJob whose ``numNodes`` was changed after mdtk wrote it would otherwise
form a group of the wrong size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from toolkit.launch.k8s import PORT, RESTART_ATTEMPT_ENV, K8sError


@dataclass(frozen=True)
class PodEnv:
    """This pod's node rank, the rendezvous host and port, the restart attempt."""

    node_rank: int
    master_addr: str
    master_port: int
    attempt: int
    source: str  # "TrainJob" or "JobSet", for the log

    @property
    def rdzv_id(self) -> str:
        """A rendezvous per attempt: a restarted set never meets the previous one's agents."""
        return f"mdtk-{self.attempt}"


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise K8sError(f"--in-pod: {name}={value!r} is not a number") from None


def read_pod_env(environ: Mapping[str, str], nodes: int, gpus: int) -> PodEnv:
    """The pod's place, checked against ``nodes`` x ``gpus``; a K8sError says what is missing
    or disagrees."""
    if "PET_NODE_RANK" in environ:
        source, rank_var, addr_var, port_var = "TrainJob", "PET_NODE_RANK", "PET_MASTER_ADDR", \
            "PET_MASTER_PORT"
        for var, want in (("PET_NNODES", nodes), ("PET_NPROC_PER_NODE", gpus)):
            got = environ.get(var)
            if got is not None and got != "auto" and got != str(want):
                raise K8sError(f"--in-pod: {var}={got} but the pod command says {want}: the "
                               "TrainJob was changed after mdtk wrote it; write it again with "
                               "mdtk launch --scheduler k8s")
    elif "JOB_COMPLETION_INDEX" in environ:
        source, rank_var, addr_var, port_var = ("JobSet", "JOB_COMPLETION_INDEX", "MASTER_ADDR",
                                                "MASTER_PORT")
    else:
        raise K8sError("--in-pod: neither PET_NODE_RANK (Kubeflow TrainJob) nor "
                       "JOB_COMPLETION_INDEX (JobSet) is set; --in-pod runs in the pods of a "
                       "manifest written by mdtk launch --scheduler k8s")
    rank = _int(environ, rank_var)
    if not 0 <= rank < nodes:
        raise K8sError(f"--in-pod: {rank_var}={rank} is not a node of --nodes {nodes}")
    if not environ.get(addr_var):
        raise K8sError(f"--in-pod: {addr_var} is not set (the first pod's host name)")
    port = _int(environ, port_var) if environ.get(port_var) else PORT
    attempt = _int(environ, RESTART_ATTEMPT_ENV) if environ.get(RESTART_ATTEMPT_ENV) else 0
    return PodEnv(rank, environ[addr_var], port, attempt, source)
