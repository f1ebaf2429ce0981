"""``mdtk train CONFIG.yaml [key.path=value ...]``: run on every rank of a launch."""

from __future__ import annotations

import typer


def train(
    config: str = typer.Argument(..., help="Training YAML (see examples/sft_tiny.yaml)."),
    overrides: list[str] = typer.Argument(
        None, help="Overrides as key.path=value, e.g. train.steps=10 parallel.tp=2."),
    check: bool = typer.Option(False, "--check",
                               help="Validate the config (and overrides) and exit."),
) -> None:
    """Fine-tune or pretrain with megatron-core + DeepSpeed. Launch it on every rank:
    `torchrun --nproc-per-node N -m toolkit.cli train CFG`, `mdtk launch -n N -- train CFG`,
    the deepspeed launcher, or srun. Writes metrics.jsonl, checkpoints and the HF export under
    output_dir."""
    from toolkit.train.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if check:
        typer.echo("config OK")
        return
    from toolkit.train.trainer import run

    try:
        run(cfg)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    _exit_cleanly()


def _exit_cleanly() -> None:
    """Wait for every rank, then leave without interpreter teardown: gloo/DeepSpeed teardown
    sometimes aborts a finished run ("terminate called without an active exception"), which
    the launcher would report as a failure."""
    import os
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
