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
    """Fine-tune or pretrain with megatron-core + DeepSpeed. One process (tp = pp = cp = 1)
    runs as is; N ranks are launched on every rank: `mdtk launch -n N -- train CFG`, `torchrun
    --nproc-per-node N -m toolkit.cli train CFG`, the deepspeed launcher, or srun. Writes
    metrics.jsonl, checkpoints and the HF export under output_dir, once the config, model and
    data are checked (a refused run writes nothing)."""
    import os

    from toolkit.train.config import load_config

    if not check and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from toolkit import runtime

        # Join the launch first: a config error then stops every rank together, so rank 0
        # reports it once before the launcher tears the others down (toolkit.cli.main).
        runtime.init_distributed()
    cfg = load_config(config, overrides or [])
    if check:
        typer.echo("config OK")
        return
    from toolkit import errors
    from toolkit.train.loop.faults import TrainingStopped, stop_file
    from toolkit.train.trainer import run

    try:
        run(cfg)
    except TrainingStopped as e:  # every rank: a requested stop, saved
        if int(os.environ.get("RANK", "0")) == 0:
            where = f"checkpoint {e.path}" if e.path else "the checkpoint already there"
            stop = stop_file(str(cfg.output_dir))
            again = (f"remove {stop} and launch it again" if stop.exists() else
                     "launch it again")
            typer.echo(f"[mdtk train] stopped at step {e.step} ({e.reason}); {where} holds the "
                       f"run: {again} to resume (exit status {errors.EXIT_STOPPED}).", err=True)
        _exit_cleanly(errors.EXIT_STOPPED)
    _exit_cleanly()


def _exit_cleanly(status: int = 0) -> None:
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
    os._exit(status)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
