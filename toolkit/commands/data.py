"""``mdtk data ...``: look at training data (``preview``)."""

from __future__ import annotations

import typer

from toolkit.commands.data_preview import preview

data_app = typer.Typer(help="Training data: preview what the trainer trains on.",
                       no_args_is_help=True)
data_app.command("preview")(preview)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
