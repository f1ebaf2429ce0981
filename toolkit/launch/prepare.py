"""What ``mdtk launch`` will do, decided before anything starts: the scheduler, where the ranks
run (``LaunchSpec``), what they run (``train CONFIG ...`` for a training config, checked
against the nodes x GPUs by ``shape.check_fit``) and the environment defaults (NCCL for the
network, c10d for elastic launches); for Kubernetes also what the pods see (``k8s_job``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserError
from toolkit.launch import LaunchSpec, elastic_env
from toolkit.launch import network as net
from toolkit.launch.shape import Fit, check_fit, is_config_arg

SCHEDULERS = ("torchrun", "slurm", "deepspeed", "k8s")


class LaunchError(UserError):
    """An option combination no launch can run; the command shows it as a usage error."""


@dataclass(frozen=True)
class Launch:
    """A checked launch."""

    spec: LaunchSpec
    scheduler: str
    args: list[str]  # the mdtk command line the ranks run
    output_dir: Path | None  # the training config's output_dir (None: a bare mdtk command)
    fit: Fit | None  # the training config on this shape (None: a bare mdtk command)
    env: dict[str, str]  # defaults, each kept where the environment already sets it


def prepare_launch(args: list[str], *, nproc_per_node: int = 0, nnodes: int = 1,
                   scheduler: str = "torchrun", node_rank: int = 0,
                   master_addr: str = "127.0.0.1", master_port: int = 29500,
                   max_restarts: int = 0, network: str = "auto", slurm: bool = False,
                   rdzv_id: str = "mdtk") -> Launch:
    """Check the options and the config (a ConfigError names the numbers) and decide the rest.
    ``nproc_per_node`` 0: this node's GPUs, or 2 ranks on CPU; ``slurm``: a script path was
    given, which implies ``--scheduler slurm``. For ``k8s`` the spec holds only the counts
    (Kubernetes, not torchrun, restarts the pods)."""
    if not args:
        raise LaunchError("give a training config (mdtk launch cfg.yaml ...) or the mdtk "
                          "command to run after --, e.g. -- train cfg.yaml")
    if slurm:
        scheduler = "slurm"
    if scheduler not in SCHEDULERS:
        raise LaunchError(f"--scheduler {scheduler}: choose one of {', '.join(SCHEDULERS)}")
    if network not in net.NETWORKS:
        raise LaunchError(f"--network {network}: choose one of {', '.join(net.NETWORKS)}")
    if scheduler == "deepspeed" and max_restarts:
        raise LaunchError("--max-restarts: the DeepSpeed launcher does not restart failed "
                          "ranks; use --scheduler torchrun or slurm.")
    if scheduler == "k8s" and not (args and is_config_arg(args[0]) and nproc_per_node):
        raise LaunchError("--scheduler k8s writes manifests for a training config: give the "
                          "config first and --gpus-per-node G (the pods' GPUs)")
    n = nproc_per_node or default_nproc()
    try:
        spec = LaunchSpec(n, nnodes, node_rank, master_addr, master_port,
                          0 if scheduler == "k8s" else max_restarts, rdzv_id)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    fit = output_dir = None
    if is_config_arg(args[0]):
        fit = check_fit(args[0], args[1:], nnodes, n)
        output_dir = Path(str(fit.cfg.output_dir))
        args = ["train", *args]
    env = net.nccl_defaults(network, nnodes) | elastic_env(spec)
    return Launch(spec, scheduler, list(args), output_dir, fit, env)


def default_nproc() -> int:
    """This node's GPUs, or 2 ranks on CPU."""
    from toolkit import runtime

    if runtime.use_cuda():
        import torch

        return torch.cuda.device_count()
    return 2


def k8s_job(launch: Launch, *, kind: str, image: str | None, name: str,
            namespace: str | None, queue: str | None, volumes: list[str],
            max_restarts: int | None, stop_minutes: int):
    """The Kubernetes job of a checked ``--scheduler k8s`` launch: the options checked, and
    every path of the config checked against the volumes the pods mount (``k8s_paths``)."""
    from toolkit.launch.k8s import CONFIG_KEY, CONFIG_MOUNT, K8sJob, Volume, check_job
    from toolkit.launch.k8s_paths import check_paths
    from toolkit.train.config import apply_overrides
    from toolkit.train.config.typed import read_yaml

    config, overrides = launch.args[1], tuple(launch.args[2:])
    vols = tuple(Volume.parse(v) for v in volumes)
    bundled = config.startswith("bundled:")
    job = K8sJob(
        name=name, kind=kind, image=image or "", nodes=launch.spec.nnodes,
        gpus=launch.spec.nproc_per_node,
        config=config if bundled else f"{CONFIG_MOUNT}/{CONFIG_KEY}", overrides=overrides,
        config_text=None if bundled else Path(config).read_text(), env=launch.env,
        namespace=namespace, queue=queue, volumes=vols,
        max_restarts=(3 if kind == "jobset" else 0) if max_restarts is None else max_restarts,
        grace_s=60 * stop_minutes)
    check_job(job)
    check_paths(apply_overrides(read_yaml(config), overrides), vols)
    return job
