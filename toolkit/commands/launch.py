"""``mdtk launch``: run an mdtk command on N local ranks (torchrun), or write a Slurm script."""

from __future__ import annotations

import os
from pathlib import Path

import typer


def launch(
    ctx: typer.Context,
    nproc_per_node: int = typer.Option(
        0, "--nproc-per-node", "-n",
        help="Ranks on this node (default: number of GPUs, or 2 on CPU)."),
    nnodes: int = typer.Option(1, "--nnodes", help="Number of nodes."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's index (multi-node)."),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr", help="Rank-0 host."),
    master_port: int = typer.Option(29500, "--master-port", help="Rank-0 port."),
    slurm: Path | None = typer.Option(
        None, "--slurm", help="Write an sbatch script to this path instead of running."),
    partition: str | None = typer.Option(None, "--partition", help="Slurm partition."),
    time_limit: str = typer.Option("04:00:00", "--time", help="Slurm time limit."),
) -> None:
    """Run an mdtk command on N ranks (torchrun) or write a Slurm script.

    Example: `mdtk launch -n 2 -- train cfg.yaml train.steps=10`.

    Locally this execs torchrun (gloo on CPU, nccl on GPUs); with --slurm it writes an sbatch
    script that runs torchrun once per node with a c10d rendezvous.
    """
    from toolkit.launch import LaunchSpec, run_local, slurm_script

    args = list(ctx.args)
    if not args:
        raise typer.BadParameter("give the mdtk command to run after --, e.g. -- train cfg.yaml")
    n = nproc_per_node or _default_nproc()
    spec = LaunchSpec(n, nnodes, node_rank, master_addr, master_port)
    if slurm is not None:
        tmp = slurm.with_name(slurm.name + ".tmp")
        tmp.write_text(slurm_script(spec, args, partition=partition, time_limit=time_limit))
        os.replace(tmp, slurm)
        typer.echo(f"wrote {slurm} ({spec.nnodes} nodes x {spec.nproc_per_node} GPUs)")
        return
    raise typer.Exit(run_local(spec, args))


def _default_nproc() -> int:
    from toolkit import runtime

    if runtime.use_cuda():
        import torch

        return torch.cuda.device_count()
    return 2


def register(app: typer.Typer) -> None:
    app.command(
        "launch",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(launch)
