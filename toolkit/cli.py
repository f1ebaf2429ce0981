"""The ``mdtk`` command: parses arguments, calls library functions, prints for people.

Each command group lives in its own module listed in COMMAND_MODULES, which exposes
``register(app)``. Heavy imports (torch, megatron-core, DeepSpeed) happen inside the commands so
``mdtk --help`` stays fast.
"""

from __future__ import annotations

import importlib
import warnings

import typer

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
def _root() -> None:
    """Hugging Face <-> Megatron-core <-> DeepSpeed toolkit. Run `mdtk COMMAND --help`."""


COMMAND_MODULES: list[str] = [
    "toolkit.commands.env",
    "toolkit.commands.launch",
    "toolkit.commands.estimate",
    "toolkit.commands.dsconfig",
    "toolkit.commands.plan",
    "toolkit.commands.verify",
    "toolkit.commands.convert",
    "toolkit.commands.train",
    "toolkit.commands.demo",
]


def _register_all() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
