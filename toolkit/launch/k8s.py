"""Kubernetes manifests for ``mdtk launch --scheduler k8s``: a Kubeflow Trainer v2 ``TrainJob``
(``trainer.kubeflow.org/v1alpha1``, on the ``torch-distributed`` runtime) or a ``JobSet``
(``jobset.x-k8s.io/v1alpha2``), plus a ConfigMap carrying the training config (pure functions
returning plain dicts; ``to_yaml`` writes the stream).

Every pod runs ``mdtk launch CONFIG [k=v ...] --nodes N --gpus-per-node G --in-pod``: torchrun's
agent for that pod, whose node rank, rendezvous host and restart attempt come from what the
controllers put into the pod (``toolkit.launch.pods``). What the manifests settle so that the
mistakes of hand-written ones cannot happen:

* the counts: N pods (TrainJob ``numNodes``; JobSet ``parallelism = completions = N``, Indexed)
  of G processes and G ``nvidia.com/gpu`` each;
* the rendezvous: the first pod's DNS name through the headless service (JobSet's
  ``network.enableDNSHostnames``; the Trainer's ``PET_MASTER_ADDR``), port 29500;
* ``/dev/shm``: a memory-backed emptyDir (containers get 64 MiB otherwise, and NCCL's and
  gloo's shared-memory transports fail with bus errors);
* restarts (JobSet ``failurePolicy.maxRestarts``): any failed pod recreates every pod, and the
  trainer resumes from the last complete checkpoint (``checkpoint.resume: auto``), as a Slurm
  requeue does; checkpoints therefore live on a persistent volume (``toolkit.launch.k8s_paths``
  refuses an output dir elsewhere);
* SIGTERM (preemption, Kueue eviction, a deleted job): the agent forwards it to the ranks,
  which save at the next step boundary; ``terminationGracePeriodSeconds`` and torchrun's
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` give them ``--stop-minutes`` for it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from toolkit.errors import UserError

KINDS = ("trainjob", "jobset")
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
#: The Trainer's ClusterTrainingRuntime for torchrun (manifests/base/runtimes/torch_distributed)
TORCH_RUNTIME = "torch-distributed"
#: The torch runtime's replicated job and its container (runtime patches must name them); the
#: JobSet uses the same names, so pods of both kinds are called ``<name>-node-<j>-<i>``.
NODE = "node"
PORT = 29500  # the Trainer's ContainerTrainerPort; the JobSet's rendezvous port too
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PATCH_MANAGER = "mdtk/launch"  # a runtime patch's owner: a domain-prefixed path
#: The pod's restart attempt, from the annotation JobSet puts on every pod it (re)creates
RESTART_ATTEMPT_ENV = "JOBSET_RESTART_ATTEMPT"
RESTART_ANNOTATION = "jobset.sigs.k8s.io/restart-attempt"
CONFIG_MOUNT = "/etc/mdtk"
CONFIG_KEY = "config.yaml"
CONFIGMAP_LIMIT = 1 << 20  # bytes a ConfigMap may hold
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class K8sError(UserError):
    """A Kubernetes launch that cannot work as asked; the message names the option and fix."""


@dataclass(frozen=True)
class Volume:
    """A PersistentVolumeClaim (``claim``) mounted at ``mount`` in every pod."""

    claim: str
    mount: str

    @staticmethod
    def parse(text: str) -> Volume:
        """``CLAIM:/MOUNT`` -> Volume; a K8sError names what is wrong."""
        claim, sep, mount = text.partition(":")
        if not sep or not _CLAIM.match(claim) or len(claim) > 253:
            raise K8sError(f"--volume {text}: give CLAIM:MOUNT, CLAIM the name of a "
                           "PersistentVolumeClaim (lower-case letters, digits, '-', '.'), e.g. "
                           "--volume ckpt:/mnt/ckpt")
        if not mount.startswith("/") or mount.rstrip("/") in ("", "/dev/shm", CONFIG_MOUNT):
            raise K8sError(f"--volume {text}: MOUNT must be an absolute path in the pod, not "
                           f"/, /dev/shm or {CONFIG_MOUNT} (mdtk mounts those itself)")
        return Volume(claim, mount.rstrip("/"))


@dataclass(frozen=True)
class K8sJob:
    """What the manifests describe. ``config``: the config argument the pods pass to mdtk (a
    ``bundled:`` name as given, else the ConfigMap's file); ``config_text``: the file's text
    for the ConfigMap (None for a bundled config)."""

    name: str
    kind: str
    image: str
    nodes: int
    gpus: int
    config: str
    overrides: tuple[str, ...]
    config_text: str | None
    env: dict[str, str]  # NCCL defaults
    namespace: str | None = None
    queue: str | None = None
    volumes: tuple[Volume, ...] = ()
    max_restarts: int = 0
    grace_s: int = 600

    @property
    def master_addr(self) -> str:
        """The first pod's DNS name: ``<name>-node-0-0`` under the headless service ``<name>``
        (JobSet's default subdomain; the Trainer names its JobSet after the TrainJob)."""
        return f"{self.name}-{NODE}-0-0.{self.name}"


def check_job(job: K8sJob) -> None:
    """The choices no schema states: the kind, a name every derived object can carry, restarts
    only where the manifest can ask for them, a config small enough for a ConfigMap."""
    if job.kind not in KINDS:
        raise K8sError(f"--k8s-kind {job.kind}: choose one of {', '.join(KINDS)}")
    if not job.image:
        raise K8sError("--scheduler k8s needs --image IMAGE: a container image with mdtk "
                       "installed (the pods run `mdtk launch ... --in-pod`)")
    longest = f"{job.name}-{NODE}-0-{job.nodes - 1}"  # the last pod's host name
    if not _DNS_LABEL.match(job.name) or len(longest) > 63:
        raise K8sError(f"--job-name {job.name}: Kubernetes names the pods {longest}, which must "
                       "be a DNS label: lower-case letters, digits and '-', starting with a "
                       "letter, at most 63 characters; choose a shorter name")
    if job.kind == "trainjob" and job.max_restarts:
        raise K8sError(f"--max-restarts {job.max_restarts}: a TrainJob restarts as its runtime "
                       f"({TORCH_RUNTIME}) says, not per job; use --k8s-kind jobset for "
                       "restarts from the last checkpoint")
    if job.config_text is not None and len(job.config_text.encode()) > CONFIGMAP_LIMIT:
        raise K8sError(f"{job.config}: {len(job.config_text.encode())} bytes do not fit a "
                       "ConfigMap (1 MiB); move the long values (e.g. data.sources) into files")


def pod_command(job: K8sJob) -> list[str]:
    """What every pod runs: ``mdtk launch`` as this pod's torchrun agent."""
    return ["mdtk", "launch", job.config, *job.overrides, "--nodes", str(job.nodes),
            "--gpus-per-node", str(job.gpus), "--in-pod"]


def shm_size(gpus: int) -> str:
    """``/dev/shm`` for NCCL's and gloo's shared-memory transports and the data pipeline: 2 GiB
    per process, at least 4 GiB (it counts against the pod's memory only as it fills)."""
    return f"{max(4, 2 * gpus)}Gi"


def _env(job: K8sJob) -> list[dict]:
    """The container's environment: the NCCL defaults, torchrun's shutdown wait (the ranks'
    time to save on SIGTERM, a little under the pod's grace period) and the restart attempt."""
    values = {**job.env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(job.grace_s - 15, 30))}
    if job.kind == "jobset":  # the Trainer sets PET_MASTER_ADDR/PORT itself
        values |= {"MASTER_ADDR": job.master_addr, "MASTER_PORT": str(PORT)}
    attempt = {"name": RESTART_ATTEMPT_ENV, "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{RESTART_ANNOTATION}']"}}}
    return [{"name": k, "value": v} for k, v in sorted(values.items())] + [attempt]


def _volumes(job: K8sJob) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts): /dev/shm, the config, the persistent volumes."""
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(job.gpus)}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if job.config_text is not None:
        volumes.append({"name": "mdtk-config", "configMap": {"name": f"{job.name}-config"}})
        mounts.append({"name": "mdtk-config", "mountPath": CONFIG_MOUNT, "readOnly": True})
    for i, v in enumerate(job.volumes):
        volumes.append({"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": v.claim}})
        mounts.append({"name": f"pvc-{i}", "mountPath": v.mount})
    return volumes, mounts


def _metadata(job: K8sJob, name: str, queued: bool = True) -> dict:
    """Name, namespace and labels; Kueue's queue label on the job (``queued``) only."""
    meta: dict = {"name": name}
    if job.namespace:
        meta["namespace"] = job.namespace
    labels = {"app.kubernetes.io/managed-by": "mdtk"}
    if job.queue and queued:
        labels[QUEUE_LABEL] = job.queue
    meta["labels"] = labels
    return meta


def _gpus(job: K8sJob) -> dict:
    return {"limits": {"nvidia.com/gpu": job.gpus}, "requests": {"nvidia.com/gpu": job.gpus}}


def trainjob(job: K8sJob) -> dict:
    """The TrainJob: counts, image, command and env under ``trainer``; /dev/shm, the volumes
    and the grace period as a runtime patch of the torch runtime's ``node`` job (the Trainer
    refuses env in patches of that container, so env stays under ``trainer``)."""
    volumes, mounts = _volumes(job)
    pod = {"terminationGracePeriodSeconds": job.grace_s, "volumes": volumes,
           "containers": [{"name": NODE, "volumeMounts": mounts}]}
    patch = {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}]}}}}
    return {
        "apiVersion": TRAINJOB_API, "kind": "TrainJob", "metadata": _metadata(job, job.name),
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                           "name": TORCH_RUNTIME},
            "trainer": {"image": job.image, "command": pod_command(job), "env": _env(job),
                        "numNodes": job.nodes, "numProcPerNode": job.gpus,
                        "resourcesPerNode": _gpus(job)},
            "runtimePatches": [patch],
        },
    }


def jobset(job: K8sJob) -> dict:
    """The JobSet: one replicated job of N indexed pods (``JOB_COMPLETION_INDEX`` is the node
    rank), DNS host names through the headless service JobSet creates, restarts of the whole
    set on any failure (each pod fails its Job at once: backoffLimit 0, restartPolicy Never)."""
    volumes, mounts = _volumes(job)
    container = {"name": NODE, "image": job.image, "command": pod_command(job),
                 "env": _env(job), "resources": _gpus(job), "volumeMounts": mounts,
                 "ports": [{"name": "rendezvous", "containerPort": PORT}]}
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": job.grace_s,
           "containers": [container], "volumes": volumes}
    spec = {"parallelism": job.nodes, "completions": job.nodes, "completionMode": "Indexed",
            "backoffLimit": 0, "template": {"spec": pod}}
    return {
        "apiVersion": JOBSET_API, "kind": "JobSet", "metadata": _metadata(job, job.name),
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": job.max_restarts},
            "replicatedJobs": [{"name": NODE, "replicas": 1, "template": {"spec": spec}}],
        },
    }


def configmap(job: K8sJob) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(job, f"{job.name}-config", queued=False),
            "data": {CONFIG_KEY: job.config_text}}


def manifests(job: K8sJob) -> list[dict]:
    """The objects to create, in order: the ConfigMap (when the config is a file), the job."""
    check_job(job)
    docs = [configmap(job)] if job.config_text is not None else []
    return docs + [trainjob(job) if job.kind == "trainjob" else jobset(job)]


def to_yaml(docs: list[dict], header: str = "") -> str:
    """One YAML stream (``kubectl create -f``), a comment header first."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:  # the config as a block
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    lines = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    body = "---\n".join(yaml.dump(d, Dumper=Dumper, sort_keys=False, width=100) for d in docs)
    return lines + body


def describe(job: K8sJob) -> str:
    """The header of the written YAML: what it runs and how to submit it."""
    return (f"mdtk launch --scheduler k8s --k8s-kind {job.kind}: {job.nodes} pods x "
            f"{job.gpus} GPUs\nEach pod runs: {shlex.join(pod_command(job))}\n"
            "Submit: kubectl create -f THIS_FILE")
