"""What the Kubernetes controllers give the pods of a manifest from ``mdtk launch --scheduler
k8s``, for tests that start the pod command on this machine (tests/test_launch_k8s.py in
process, tests/test_launch_faults.py as real "pods").

Stand-ins for the controllers, from their sources at the versions targeted
(tests/data/k8s/README.md): the Job controller sets ``JOB_COMPLETION_INDEX`` and the host name
``<job>-<index>`` of every Indexed Job pod and annotates it with
``batch.kubernetes.io/job-completion-index``; JobSet names its Jobs ``<jobset>-<rjob>-<j>``
and annotates their pods with ``jobset.sigs.k8s.io/restart-attempt`` (and more); the Trainer's
torch plugin (pkg/runtime/framework/plugins/torch/torch.go) adds ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (from the completion-index annotation),
``PET_MASTER_ADDR`` = ``<trainjob>-node-0-0.<trainjob>`` and ``PET_MASTER_PORT`` = 29500 to the
``node`` container. The kubelet resolves ``valueFrom.fieldRef`` from the pod's metadata.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
_FIELD = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]$")


def job_of(docs: list[dict]) -> dict:
    """The TrainJob or JobSet of a manifest stream."""
    (job,) = [d for d in docs if d["kind"] in ("TrainJob", "JobSet")]
    return job


def container(job: dict) -> dict:
    """The ``node`` container as the pods get it (TrainJob: the trainer's fields)."""
    if job["kind"] == "TrainJob":
        t = job["spec"]["trainer"]
        return {"name": "node", "image": t["image"], "command": t["command"], "env": t["env"]}
    pod = job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return c


def pod_env(job: dict, index: int, attempt: int, hosts: dict[str, str] | None = None,
            port: int | None = None) -> dict[str, str]:
    """The environment of pod ``index`` in restart attempt ``attempt``: the manifest's entries
    with ``fieldRef`` resolved, plus what the controllers add. ``hosts`` maps host names (e.g.
    the first pod's DNS name to 127.0.0.1) and ``port`` replaces the rendezvous port."""
    name = job["metadata"]["name"]
    meta = {"annotations": {COMPLETION_INDEX: str(index), RESTART_ATTEMPT: str(attempt)},
            "labels": {RESTART_ATTEMPT: str(attempt)}}
    env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"{name}-node-0-{index}"}
    for entry in container(job).get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            where, key = _FIELD.match(entry["valueFrom"]["fieldRef"]["fieldPath"]).groups()
            env[entry["name"]] = meta[where][key]
    if job["kind"] == "TrainJob":
        t = job["spec"]["trainer"]
        env |= {"PET_NNODES": str(t["numNodes"]), "PET_NPROC_PER_NODE": str(t["numProcPerNode"]),
                "PET_NODE_RANK": meta["annotations"][COMPLETION_INDEX],
                "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}
    for var in ("MASTER_ADDR", "PET_MASTER_ADDR"):
        if var in env and hosts:
            env[var] = hosts.get(env[var], env[var])
    for var in ("MASTER_PORT", "PET_MASTER_PORT"):
        if var in env and port is not None:
            env[var] = str(port)
    return env


def pod_argv(job: dict, mounts: dict[str, Path]) -> list[str]:
    """The container's command for this machine: ``mdtk`` is this Python's toolkit.cli, and a
    path under a mount (e.g. the ConfigMap's /etc/mdtk) the local folder standing in for it."""
    argv = []
    for arg in container(job)["command"]:
        for mount, local in mounts.items():
            if arg.startswith(mount + "/"):
                arg = str(local / arg[len(mount) + 1:])
        argv.append(arg)
    assert argv[0] == "mdtk", argv
    return [sys.executable, "-m", "toolkit.cli", *argv[1:]]


def write_configmaps(docs: list[dict], job: dict, root: Path) -> dict[str, Path]:
    """Each ConfigMap the pods mount, written under ``root`` as the kubelet projects it:
    {mount path: local folder}."""
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    spec = (job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
            if job["kind"] == "TrainJob" else job["spec"])
    pod = spec["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    out = {}
    for volume in pod["volumes"]:
        if "configMap" not in volume:
            continue
        (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == volume["name"]]
        folder = root / volume["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for key, text in maps[volume["configMap"]["name"]]["data"].items():
            (folder / key).write_text(text)
        out[mount] = folder
    return out


def pod_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process of a "pod": its first process and all it started (torchrun starts each
    rank in a session of its own, so the pod's process group does not hold them)."""
    try:
        first = psutil.Process(proc.pid)
        return [first, *first.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_pod(proc: subprocess.Popen) -> None:
    """SIGKILL to every process of the pod, as when its node is lost or its grace period ends
    (the container runtime kills the container's whole cgroup)."""
    for p in pod_processes(proc):
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def delete_pod(proc: subprocess.Popen, grace_s: float) -> int:
    """What deleting a pod does: SIGTERM to the container's first process, SIGKILL to all of
    them when ``terminationGracePeriodSeconds`` has passed; the first process's status."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        kill_pod(proc)
        return proc.returncode
