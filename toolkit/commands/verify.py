"""``mdtk verify A B``: same tokens through two checkpoints; exit 1 when logits differ."""

from __future__ import annotations

import typer

from toolkit import errors


def verify(
    a: str = typer.Argument(..., help="Checkpoint A: a folder (format detected), or KIND:PATH "
                            "with KIND one of hf, hf-mcore, mcore, megatron-legacy."),
    b: str = typer.Argument(..., help="Checkpoint B, same forms as A."),
    tol: float = typer.Option(1e-4, "--tol", help="Max absolute logit difference allowed."),
    batch: int = typer.Option(2, "--batch", min=1, help="Sequences in the token batch."),
    seq_len: int = typer.Option(16, "--seq-len", min=1, help="Tokens per sequence."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random token batch."),
) -> None:
    """Run A and B on one fixed random token batch (fp32) and compare logits. Prints the max
    absolute and relative difference; above --tol also the per-layer differences, exit 1.
    `hf-mcore:PATH` loads an HF folder into megatron-core through mdtk's adapter; `mcore:PATH`
    is a torch_dist checkpoint loaded by megatron-core's own dist_checkpointing.load;
    `megatron-legacy:PATH` merges mp_rank_XX files of any tp/pp (both need the hf_config/
    folder `mdtk convert` writes)."""
    from toolkit.convert.verify import verify as run_verify

    try:
        result = run_verify(a, b, batch=batch, seq_len=seq_len, seed=seed)
    except (ValueError, FileNotFoundError) as err:
        errors.say(err)
        raise typer.Exit(2) from err
    typer.echo(f"max abs diff {result.max_abs:.3e}  max rel diff {result.max_rel:.3e}  "
               f"(tolerance {tol:g})")
    if result.ok(tol):
        typer.echo("OK: logits match")
        return
    typer.echo("FAIL: logits differ. Per-layer max abs diff of decoder layer outputs:")
    for i, d in enumerate(result.layers):
        typer.echo(f"  layer {i:3d}: {d:.3e}")
    raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
