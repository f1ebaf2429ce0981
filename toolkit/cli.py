"""The ``mdtk`` command: parses arguments, calls library functions, prints for people.

Each command group lives in its own module listed in COMMAND_MODULES, which exposes
``register(app)``. Heavy imports (torch, megatron-core, DeepSpeed) happen inside the commands so
``mdtk --help`` stays fast.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import typer

from toolkit import errors

# Library noise, once per rank, that says nothing about the run: megatron-core warns about each
# optional kernel package it cannot import (`mdtk env` lists them) and about its own default
# cuda_graph_scope; DeepSpeed calls a torch collective torch has renamed.
for _pattern, _category in (
    (r"(Transformer Engine and Apex are|Apex is) not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),
):
    warnings.filterwarnings("ignore", message=_pattern, category=_category)

app = typer.Typer(
    name="mdtk",
    help="Hugging Face <-> Megatron-core <-> DeepSpeed toolkit: model adapters, DeepSpeed "
    "configs, 3D/5D parallel training and checkpoint conversion.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root(
    debug: bool = typer.Option(
        False, "--debug", help="Show the traceback of errors otherwise reported as one `error:` "
        f"line (also {errors.DEBUG_ENV}=1; passed on to the ranks `mdtk launch` starts)."),
) -> None:
    """Hugging Face <-> Megatron-core <-> DeepSpeed toolkit. Run `mdtk COMMAND --help`."""
    if debug:
        os.environ[errors.DEBUG_ENV] = "1"  # inherited by torchrun and its ranks


COMMAND_MODULES: list[str] = [
    "toolkit.commands.env",
    "toolkit.commands.launch",
    "toolkit.commands.estimate",
    "toolkit.commands.dsconfig",
    "toolkit.commands.plan",
    "toolkit.commands.verify",
    "toolkit.commands.generate",
    "toolkit.commands.convert",
    "toolkit.commands.train",
    "toolkit.commands.demo",
    "toolkit.commands.data",
]


def _register_all() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)


_register_all()


def main() -> None:
    """``mdtk``: a ``UserError`` (config, data, layout, checkpoint, resume) from any command is
    one ``error:`` line and exit status ``errors.EXIT_STATUS``; anything else is a bug and keeps
    its traceback."""
    try:
        app()
    except errors.UserError as e:
        if errors.debug():
            raise
        report_user_error(e)


def report_user_error(e: errors.UserError) -> None:
    """Print ``error: ...`` once per launch (rank 0: every rank raises the same error, see
    ``runtime.failing_together``) and exit with ``errors.EXIT_STATUS`` on every rank, so the
    launcher reports a failure."""
    dist = sys.modules.get("torch.distributed")
    joined = dist is not None and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if joined else int(os.environ.get("RANK", "0"))
    if rank == 0:
        errors.say(e)
    if not joined:
        sys.exit(errors.EXIT_STATUS)
    # The launcher stops the other ranks once one exits: leave after rank 0 has printed (bounded
    # wait, in case a rank failed alone), and without interpreter teardown (gloo / DeepSpeed
    # teardown can abort, see commands/train.py).
    import datetime

    try:
        dist.barrier(async_op=True).wait(datetime.timedelta(seconds=30))
    except Exception:  # a rank that is gone or elsewhere: leave anyway
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(errors.EXIT_STATUS)


if __name__ == "__main__":
    main()
