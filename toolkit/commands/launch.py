"""``mdtk launch``: start a training config (or any mdtk command) on N nodes x G GPUs with
torchrun, the DeepSpeed launcher, a Slurm batch script or Kubernetes manifests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

K8S_KIND = typer.Option("trainjob", "--k8s-kind", help="k8s: trainjob (Kubeflow Trainer v2, "
                        "torch-distributed runtime) or jobset (JobSet, restarts on failure).")
IMAGE = typer.Option(None, "--image", help="k8s: the container image (mdtk installed).")
NAMESPACE = typer.Option(None, "--namespace", help="k8s: the namespace of the objects.")
QUEUE = typer.Option(None, "--queue", help="k8s: the Kueue LocalQueue that admits the job.")
VOLUME = typer.Option(None, "--volume", help="k8s: CLAIM:MOUNT, a PersistentVolumeClaim "
                      "mounted in every pod (repeatable); output_dir must lie on one.")
OUTPUT = typer.Option(None, "--output", "-o", help="k8s: where the manifests go (default "
                      "./JOB_NAME.yaml).")
IN_POD = typer.Option(False, "--in-pod", help="Run as this pod's torchrun agent in a manifest "
                      "of --scheduler k8s: node rank, rendezvous and restart attempt from the "
                      "pod's environment (TrainJob PET_*, JobSet JOB_COMPLETION_INDEX).")


def launch(
    ctx: typer.Context,
    nproc_per_node: int = typer.Option(
        0, "--gpus-per-node", "--nproc-per-node", "-n",
        help="Ranks per node: GPUs (on CPU, processes). Default: this node's GPUs, or 2 on "
             "CPU."),
    nnodes: int = typer.Option(1, "--nodes", "--nnodes", help="Number of nodes."),
    scheduler: str = typer.Option(
        "torchrun", "--scheduler", help="torchrun (this node), slurm (writes an sbatch "
        "script), deepspeed (the DeepSpeed launcher with a hostfile) or k8s (writes Kubernetes "
        "manifests)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's index (torchrun, "
                                  "one command per node)."),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr",
                                    help="Rendezvous host (node 0)."),
    master_port: int = typer.Option(29500, "--master-port", help="Rendezvous port."),
    max_restarts: int | None = typer.Option(
        None, "--max-restarts", help="Restart the group this often after a failed rank; the "
        "trainer resumes from its latest complete checkpoint (default 0; k8s jobset: 3)."),
    hostfile: Path | None = typer.Option(
        None, "--hostfile", help="DeepSpeed hostfile ('HOST slots=N' lines); default: "
        "localhost for one node, written under output_dir."),
    network: str = typer.Option("auto", "--network",
                                help="NCCL defaults for ib or ethernet (auto: detect)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would run (or the "
                                 "script, the manifests); start nothing, write nothing."),
    slurm: Path | None = typer.Option(
        None, "--slurm", "--script", help="Where the sbatch script goes (--scheduler slurm; "
        "default output_dir/sbatch.sh). Giving it implies --scheduler slurm."),
    partition: str | None = typer.Option(None, "--partition", help="Slurm partition."),
    time_limit: str = typer.Option("04:00:00", "--time", help="Slurm time limit."),
    stop_minutes: int = typer.Option(
        10, "--stop-minutes", min=1, help="Slurm: ask the ranks to save and stop this many "
        "minutes before the time limit (the job is requeued and resumes); k8s: the pods' "
        "grace period between SIGTERM and SIGKILL, for that save."),
    job_name: str = typer.Option("mdtk", "--job-name", help="Slurm job name; k8s object name."),
    k8s_kind: str = K8S_KIND, image: str | None = IMAGE, namespace: str | None = NAMESPACE,
    queue: str | None = QUEUE, volume: list[str] | None = VOLUME, output: Path | None = OUTPUT,
    in_pod: bool = IN_POD,
) -> None:
    """Run a training config, or any mdtk command, on N nodes x G GPUs.

    Examples:
    `mdtk launch cfg.yaml train.steps=100 --nodes 2 --gpus-per-node 8 --scheduler slurm`;
    `mdtk launch cfg.yaml --nodes 2 --gpus-per-node 8 --node-rank 0 --master-addr n0`
    (and --node-rank 1 on the other node); `mdtk launch -n 2 -- env --json`;
    `mdtk launch cfg.yaml --nodes 2 --gpus-per-node 8 --scheduler k8s --image IMG --volume
    ckpt:/mnt/ckpt -o job.yaml` (then kubectl create -f job.yaml).

    With a config (a .yaml or bundled: name first), its layout and batch are checked against
    the nodes x GPUs before anything starts. torchrun and deepspeed start the job here; slurm
    writes an sbatch script (requeued with a save before its time limit); k8s writes a
    TrainJob or JobSet (and a ConfigMap with the config) once every path of the config is on a
    --volume (or bundled: / a hub id). --dry-run prints what would run or be written instead.
    """
    from toolkit.launch.prepare import LaunchError, prepare_launch

    # --in-pod: the place comes from the pod (a K8sError when it cannot: one `error:` line)
    node_rank, master_addr, master_port, rdzv_id = _pod_place(scheduler, nnodes, nproc_per_node) \
        if in_pod else (node_rank, master_addr, master_port, "mdtk")
    try:  # a ConfigError of the training config goes on: one `error:` line
        job = prepare_launch(list(ctx.args), nproc_per_node=nproc_per_node, nnodes=nnodes,
                             scheduler=scheduler, node_rank=node_rank, master_addr=master_addr,
                             master_port=master_port, max_restarts=max_restarts or 0,
                             network=network, slurm=slurm is not None, rdzv_id=rdzv_id)
    except LaunchError as e:
        raise typer.BadParameter(str(e)) from None
    _announce(job)
    if job.scheduler == "k8s":
        from toolkit.launch.prepare import k8s_job

        _k8s(k8s_job(job, kind=k8s_kind, image=image, name=job_name, namespace=namespace,
                     queue=queue, volumes=volume or [], max_restarts=max_restarts,
                     stop_minutes=stop_minutes), output, dry_run)
        return
    if job.scheduler == "slurm":
        _slurm(job.spec, job.args, job.output_dir, slurm, dry_run, job.env, partition=partition,
               time_limit=time_limit, stop_minutes=stop_minutes, job_name=job_name)
        return
    raise typer.Exit(_start(job, hostfile, dry_run))


def _pod_place(scheduler: str, nnodes: int, nproc_per_node: int) -> tuple[int, str, int, str]:
    """(node rank, rendezvous host, port, rendezvous id) of this pod (``--in-pod``)."""
    from toolkit.launch.pods import read_pod_env

    if scheduler != "torchrun":
        raise typer.BadParameter("--in-pod runs this pod's torchrun agent: drop --scheduler")
    pod = read_pod_env(os.environ, nnodes, nproc_per_node)
    _say(f"[mdtk launch] {pod.source} pod: node {pod.node_rank} of {nnodes}, restart attempt "
         f"{pod.attempt}, rendezvous {pod.master_addr}:{pod.master_port}")
    return pod.node_rank, pod.master_addr, pod.master_port, pod.rdzv_id


def _k8s(job, output: Path | None, dry_run: bool) -> None:
    """Print or write the manifests (written whole or not at all)."""
    from toolkit.atomic import write_text
    from toolkit.launch.k8s import describe, manifests, to_yaml

    text = to_yaml(manifests(job), describe(job))
    if dry_run:
        typer.echo(text, nl=False)
        return
    path = output or Path(f"{job.name}.yaml")
    write_text(path, text)
    typer.echo(f"wrote {path} ({job.kind}: {job.nodes} pods x {job.gpus} GPUs); submit it "
               f"with: kubectl create -f {path}")


def _announce(job) -> None:
    from toolkit.launch import network as net

    spec = job.spec
    if job.fit is not None:
        plan = job.fit.plan
        _say(f"[mdtk launch] {spec.nnodes} x {spec.nproc_per_node} = {spec.world_size} ranks: "
             f"{plan.layout.describe()}, global batch {plan.global_batch} = micro "
             f"{plan.micro_batch} x {plan.grad_accum} accumulation x dp {plan.layout.dp}")
        for note in job.fit.notes:
            _say(f"[mdtk launch] note: {note}")
    if job.scheduler != "k8s":  # the manifests carry theirs, whatever is set here
        _say("[mdtk launch] environment: " + " ".join(net.describe(job.env, os.environ)))


def _start(job, hostfile: Path | None, dry_run: bool) -> int:
    """torchrun or the DeepSpeed launcher on this node; the exit status."""
    from toolkit import errors
    from toolkit.launch import network as net
    from toolkit.launch import run_local, torchrun_argv

    os.environ.update(net.apply(job.env, os.environ))
    if job.output_dir is not None and not dry_run:
        _clear_stop_file(job.output_dir)
    if job.scheduler == "deepspeed":
        return _deepspeed(job.spec, job.args, job.output_dir, hostfile, dry_run)
    if dry_run:
        import shlex

        typer.echo(shlex.join(torchrun_argv(job.spec, job.args)))
        return 0
    status = run_local(job.spec, job.args)
    if status == errors.EXIT_STOPPED:
        typer.echo("[mdtk launch] the ranks saved a checkpoint and stopped on request; run the "
                   "same command again to resume.", err=True)
    return status


def _say(text: str) -> None:
    """What the launch will do, for people: on stderr, so stdout holds only the command or
    script (``--dry-run > job.sh``)."""
    typer.echo(text, err=True)


def _clear_stop_file(output_dir: Path) -> None:
    """A stop asked of an earlier run is done once that run has stopped: a new launch runs."""
    from toolkit.train.loop.faults import stop_file

    path = stop_file(output_dir)
    if path.exists():
        _say(f"[mdtk launch] removing {path} left by a stopped earlier run")
        path.unlink(missing_ok=True)


def _slurm(spec, args: list[str], output_dir: Path | None, script: Path | None, dry_run: bool,
           env: dict[str, str], **kw) -> None:
    from toolkit.atomic import write_text
    from toolkit.launch import slurm_script
    from toolkit.train.loop.faults import stop_file

    base = output_dir or Path.cwd()
    log_dir = base.resolve() / "logs"
    stop = str(stop_file(output_dir.resolve())) if output_dir is not None else None
    text = slurm_script(spec, args, log_dir=str(log_dir), stop_file=stop, env=env,
                        venv=_venv(), **kw)
    if dry_run:
        typer.echo(text, nl=False)
        return
    path = script or base / "sbatch.sh"
    log_dir.mkdir(parents=True, exist_ok=True)  # sbatch does not create the log folder
    write_text(path, text)
    path.chmod(0o755)
    typer.echo(f"wrote {path} ({spec.nnodes} nodes x {spec.nproc_per_node} GPUs); submit it "
               f"with: sbatch {path}")


def _venv() -> str | None:
    """The virtual environment this mdtk runs from, activated by the sbatch script."""
    return sys.prefix if sys.prefix != sys.base_prefix else None


def _deepspeed(spec, args: list[str], output_dir: Path | None, hostfile: Path | None,
               dry_run: bool) -> int:
    import shlex
    import subprocess

    from toolkit.atomic import write_text
    from toolkit.launch import rank_env
    from toolkit.launch.dslauncher import (
        HostfileError,
        check_hostfile,
        deepspeed_argv,
        hostfile_text,
        read_hostfile,
    )

    if hostfile is None:
        if spec.nnodes > 1:
            raise typer.BadParameter(f"--nodes {spec.nnodes} with --scheduler deepspeed needs "
                                     "--hostfile listing the nodes ('HOST slots=N' lines).")
        if output_dir is not None:
            hostfile = output_dir / "hostfile"
        else:  # a bare command: keep the working folder clean
            import tempfile

            hostfile = Path(tempfile.gettempdir()) / f"mdtk-hostfile-{os.getpid()}"
        text = hostfile_text(["localhost"], spec.nproc_per_node)
        _say(f"[mdtk launch] hostfile {hostfile}:\n{text.rstrip()}")
        if not dry_run:
            write_text(hostfile, text)
    else:
        try:
            check_hostfile(read_hostfile(hostfile), spec, hostfile)
        except (OSError, HostfileError) as e:
            raise typer.BadParameter(str(e)) from None
    shown = deepspeed_argv(spec, hostfile, args, executable=["deepspeed"])
    typer.echo(shlex.join(shown))
    if dry_run:
        return 0
    env = rank_env(spec, os.environ)
    return subprocess.run(deepspeed_argv(spec, hostfile, args), env=env, check=False).returncode


def register(app: typer.Typer) -> None:
    app.command(
        "launch",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(launch)
