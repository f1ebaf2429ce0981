"""``mdtk data preprocess`` / ``mdtk data merge``: Megatron indexed datasets from documents;
``mdtk data preview``: what the trainer trains on."""

from __future__ import annotations

import typer

from toolkit.commands.data_preview import preview

data_app = typer.Typer(help="Training data: preview what the trainer trains on; tokenise "
                       "pretraining documents into Megatron indexed datasets (PREFIX.bin + "
                       "PREFIX.idx) and merge them.", no_args_is_help=True)
data_app.command("preview")(preview)


def _shard(value: str | None) -> tuple[int, int]:
    if value is None:
        return (0, 1)
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise typer.BadParameter(f"{value!r}: use I/N, e.g. 3/8 (shard 3 of 8, from 0).") from None
    if not 0 <= i < n:
        raise typer.BadParameter(f"{value!r}: I must be in [0, N).")
    return (i, n)


@data_app.command("preprocess")
def preprocess(
    inputs: list[str] = typer.Argument(..., help="JSON Lines (.jsonl, .jsonl.gz, .json), Parquet, "
                                       "text files (a document per paragraph), folders, globs "
                                       "or HF hub dataset names; read in the order given."),
    tokenizer: str = typer.Option(..., "--tokenizer", help="HF tokenizer folder or hub id (a "
                                  "fast tokenizer is used when it has one)."),
    output_prefix: str = typer.Option(..., "--output-prefix", help="Writes "
                                      "OUTPUT_PREFIX_{key}_document.bin/.idx per JSON key."),
    json_keys: list[str] = typer.Option(["text"], "--json-keys", help="Fields to tokenise, "
                                        "one dataset each (repeat the option or separate with "
                                        "commas for several)."),
    append_eod: bool = typer.Option(False, "--append-eod", help="End every non-empty document "
                                    "with the tokenizer's EOS id."),
    include_special_tokens: bool = typer.Option(
        False, "--include-special-tokens", help="Encode with the tokenizer's special tokens "
        "(its BOS/EOS convention), as Megatron-LM's --tokenizer-hf-include-special-tokens; "
        "default: the text's tokens only, as Megatron-LM."),
    workers: int = typer.Option(1, "--workers", min=1, help="Tokenising processes (one core "
                                "each)."),
    shard: str | None = typer.Option(None, "--shard", help="I/N: only the I-th of N contiguous "
                                     "parts of the input (from 0), written as OUTPUT_PREFIX_"
                                     "shardIIIII-of-NNNNN_{key}_document; a finished shard is not "
                                     "redone. Merge them in order with `mdtk data merge`."),
    batch_size: int = typer.Option(1024, "--batch-size", min=1, help="Documents per batch a "
                                   "worker tokenises (memory is bounded by batches in flight)."),
    dtype: str = typer.Option("auto", "--dtype", help="Token dtype: auto (Megatron-LM's: uint16 "
                              "below 65,500 tokens, else int32), uint16 or int32."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Tokenise documents into Megatron indexed datasets, byte-identical to Megatron-LM's
    tools/preprocess_data.py with the same tokenizer and flags (`--tokenizer-type
    HuggingFaceTokenizer --tokenizer-model DIR`), but with batched fast-tokenizer workers.

    mdtk data preprocess corpus/*.jsonl --tokenizer ./tok --output-prefix data/corpus --append-eod
    --workers 16

    On N nodes: `--shard I/N` on node I, then `mdtk data merge data/corpus_shard*_text_document
    --output-prefix data/corpus_text_document`."""
    from toolkit.train.data.preprocess import TokenizeSpec
    from toolkit.train.data.preprocess import preprocess as run

    keys = tuple(k for arg in json_keys for k in arg.split(",") if k)
    spec = TokenizeSpec(tokenizer, keys, append_eod, include_special_tokens, dtype)
    s = run(inputs, spec, output_prefix, workers=workers, shard=_shard(shard),
            batch_docs=batch_size, progress=not quiet)
    if s.skipped:
        typer.echo(f"shard {shard} is complete already ({', '.join(s.outputs.values())}): "
                   "not redone.")
        return
    rate = s.documents / s.seconds if s.seconds else 0.0
    typer.echo(f"{s.documents:,} documents, {s.tokens:,} tokens ({s.dtype}, largest id "
               f"{s.max_token_id:,}, vocab {s.vocab_size:,}) in {s.seconds:.1f} s: {rate:,.0f} "
               f"docs/s, {s.nbytes / max(s.seconds, 1e-9) / 2**20:,.1f} MB/s")
    for key, prefix in s.outputs.items():
        typer.echo(f"  {key}: {prefix}.bin / .idx")


@data_app.command("merge")
def merge(
    prefixes: list[str] = typer.Argument(..., help="Indexed datasets (PREFIX, or PREFIX.idx), "
                                         "concatenated in this order."),
    output_prefix: str = typer.Option(..., "--output-prefix", help="Writes "
                                      "OUTPUT_PREFIX.bin/.idx."),
) -> None:
    """Concatenate indexed datasets of one dtype without re-tokenising (Megatron-LM's
    IndexedDatasetBuilder.add_index, byte for byte, streaming). Shards of `mdtk data preprocess
    --shard` merged in order equal one run over the whole input."""
    from toolkit.train.data.indexed_format import merge as run
    from toolkit.train.data.indexed_format import strip_suffix

    info = run([strip_suffix(p) for p in prefixes], output_prefix)
    typer.echo(f"{len(prefixes)} datasets -> {output_prefix}.bin / .idx: {info.documents:,} "
               f"documents, {info.tokens:,} tokens ({info.dtype.name})")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
