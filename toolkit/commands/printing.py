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


def print_traffic(costs: dict, title: str) -> None:
    """The data-parallel traffic of plans side by side (``StepCost`` by name), to stderr: GB one
    GPU sends per step over NVLink and over the network, and each plan's cross-node bytes
    against the first's."""
    from toolkit.planner.zeropp import traffic_rows

    say = typer.echo
    names = list(costs)
    say(title, err=True)
    say(f"  {'collective':36s}" + "".join(f"{n[:21]:>22s}" for n in names), err=True)
    say(f"  {'':36s}" + "".join(f"{'NVLink':>11s}{'network':>11s}" for _ in names), err=True)
    for label, cells in traffic_rows(costs):
        say(f"  {label:36s}" + "".join(f"{a / 1e9:11.2f}{b / 1e9:11.2f}" for a, b in cells),
            err=True)
    base = costs[names[0]].cross_node_bytes
    if base:
        ratios = ", ".join(f"{n} {c.cross_node_bytes / base:.3f}" for n, c in costs.items())
        say(f"  cross-node bytes against {names[0]}: {ratios}; step "
            + ", ".join(f"{n} {c.step:.3g} s" for n, c in costs.items()), err=True)
