"""``mdtk demo``: the built-in CPU demo (tiny Llama, bundled data, 2 gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import typer


def demo(
    out: Path = typer.Option(Path("build/demo"), "--out",
                             help="Folder for everything it makes (relative: to the current one)."),
    nproc: int = typer.Option(2, "--nproc", help="Ranks to launch (gloo on CPU)."),
    steps: int | None = typer.Option(None, "--steps",
                                     help="Training steps (default: the example config's)."),
) -> None:
    """Build a tiny HF Llama, fine-tune it on the bundled SFT data with megatron-core +
    DeepSpeed on 2 ranks (config chosen by the generator), export to HF and check the export's
    logits against the trained model."""
    from rich.console import Console
    from rich.table import Table

    from toolkit.demo import run_demo

    console = Console()
    console.rule("mdtk demo")
    try:
        r = run_demo(out, nproc=nproc, steps=steps,
                     log=lambda msg: console.print(msg, markup=False, highlight=False,
                                                   soft_wrap=True))
    except RuntimeError as e:
        console.print(f"[red]demo failed: {e}[/red]")
        raise typer.Exit(1) from None
    table = Table(show_header=False, title="demo result")
    table.add_row("training loss", f"{r.first_loss:.4f} -> {r.last_loss:.4f}")
    if r.val_losses:
        first, last = min(r.val_losses), max(r.val_losses)
        table.add_row("validation loss",
                      f"{r.val_losses[first]:.4f} (step {first}) -> {r.val_losses[last]:.4f} "
                      f"(step {last})")
    table.add_row("HF export", str(r.export_dir))
    if r.export_max_abs_diff is not None:
        table.add_row("export logits vs trained model", f"max abs diff {r.export_max_abs_diff:.2e}")
    console.print(table)
    ok = r.last_loss < r.first_loss and (not r.val_losses or
                                          r.val_losses[max(r.val_losses)] <
                                          r.val_losses[min(r.val_losses)])
    if not ok:
        console.print("[red]the demo did not learn: see metrics.jsonl[/red]")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
