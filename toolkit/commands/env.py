"""``mdtk env``: what will run here."""

from __future__ import annotations

import dataclasses
import json

import typer


def env(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead of a table."),
) -> None:
    """Print versions (torch, megatron-core, DeepSpeed, transformers), the device (CUDA or CPU),
    the communication backend, and which optional pieces (Transformer Engine, apex, DeepSpeed
    cpu_adam / async_io / fused_adam ops) are available."""
    from toolkit.runtime.envinfo import collect

    report = collect()
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(report), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mdtk environment", show_header=False)
    for name, version in report.versions.items():
        table.add_row(name, version)
    table.add_row("device", report.device)
    table.add_row("backend", report.backend)
    for name, state in report.optional.items():
        table.add_row(name, state)
    if report.cpu_patches:
        table.add_row("CPU mode", f"{len(report.cpu_patches)} CUDA-only calls redirected "
                      "(toolkit/runtime/cpu_compat.py)")
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command("env")(env)
