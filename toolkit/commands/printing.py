"""How commands report: a refusal as one ``error:`` line and exit status 1, and the per-rank
memory table ``mdtk estimate`` and ``mdtk ds-config`` print."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import typer

from toolkit import errors

if TYPE_CHECKING:
    from toolkit.memory import Estimate


def fail(message: str) -> NoReturn:
    errors.say(message)
    raise typer.Exit(1)


def print_estimate(est: Estimate, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from toolkit.memory import GIB

    table = Table(title=title)
    for col in ("what", "device", "GiB", "note"):
        table.add_column(col, justify="right" if col == "GiB" else "left")
    for item in est.items:
        note = ("peak only; " if item.transient else "") + item.note
        table.add_row(item.what, item.device, f"{item.bytes / GIB:.3f}", note.strip("; "))
    for device in ("gpu", "cpu", "nvme"):
        if est.total(device):
            table.add_row(f"[bold]total {device}", device, f"[bold]{est.total(device) / GIB:.3f}",
                          "")
    Console().print(table)
