"""``mdtk data preview CONFIG.yaml [key=value ...] [--rows N]``: the training sequences as the
trainer will see them (``toolkit.train.data.preview``), without building a model."""

from __future__ import annotations

import typer


def preview(
    config: str = typer.Argument(..., help="Training YAML (the same file `mdtk train` reads)."),
    overrides: list[str] = typer.Argument(
        None, help="Overrides as key.path=value, e.g. data.pack=true train.seq_len=512."),
    rows: int = typer.Option(3, "--rows", min=0, help="Training sequences to show, in the order "
                             "the first steps draw them (GRPO: prompts or recorded groups)."),
) -> None:
    """Show the first training sequences after template, truncation and packing: text between
    [[ and ]] carries loss, || marks where an example (or an EOS-cut document) starts and
    attention and positions restart, <pad xN> is padding. Then a summary over the training
    split: rows read, dropped, truncated (per format); sequences, examples, tokens, loss tokens,
    padding; examples per sequence. Prepares (and caches) the data like `mdtk train`.
    data.mode=grpo: the first prompts as the model sees them (token counts, the columns the
    reward functions receive), or with grpo.rollouts the recorded groups (each completion and
    its reward); then counts over all of them."""
    from toolkit.train.config import load_config
    from toolkit.train.data import DataSettings, load_tokenizer, prepare_data, with_reset_at_eod
    from toolkit.train.data.preview import first_sequences, format_summary, render, summarize

    cfg = load_config(config, overrides or [])
    if cfg.data.mode == "grpo":  # prompts or recorded rollouts, read (and the reward
        # functions probed on them) as the trainer does
        from toolkit.train.data.preview import grpo_listing
        from toolkit.train.objectives.registry import objective_data

        for line in grpo_listing(objective_data(cfg), rows):
            typer.echo(line)
        return
    data = with_reset_at_eod(prepare_data(DataSettings.from_config(cfg), cfg.tokenizer_path,
                                          cfg.data_cache_dir, cfg.data.num_proc),
                             cfg.data.reset_at_eod)
    tokenizer = load_tokenizer(cfg.tokenizer_path)
    for n, i in enumerate(first_sequences(data.train, rows, cfg.train.seed, cfg.data.shuffle)):
        typer.echo(f"--- sequence {n} (training sample {i}) ---")
        typer.echo(render(data.train, int(i), tokenizer))
    typer.echo("--- summary (training split) ---")
    for line in format_summary(summarize(data)):
        typer.echo(line)
