"""``mdtk convert SRC DST --to ...`` and ``mdtk inspect PATH``: offline checkpoint conversion."""

from __future__ import annotations

from pathlib import Path

import typer

from toolkit import errors

_SRC = typer.Argument(..., help="Source checkpoint folder: HF (config.json + safetensors/.bin), "
                      "megatron-core torch_dist or legacy Megatron (the run folder with "
                      "latest_checkpointed_iteration.txt, or an iter_XXXXXXX folder), or a "
                      "DeepSpeed checkpoint written by `mdtk train` (a step_XXXXXXX folder or the "
                      "checkpoint root). The format is detected.")
_DST = typer.Argument(..., help="Output folder (must not exist unless --overwrite). Written into a "
                      "temporary sibling and renamed at the end.")
_TO = typer.Option(..., "--to", help="Target format: hf, mcore (megatron-core torch_dist, layout "
                   "independent), megatron-legacy "
                   "(iter_XXXXXXX/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt) or trainer (a `mdtk "
                   "train` checkpoint at another layout, with its optimizer state; DST is the new "
                   "checkpoint root, see docs/training.md) or hf-peft (the LoRA / DoRA adapters of "
                   "a `mdtk train` run as an HF PEFT folder; --to hf --merge-lora merges them).")
_TP = typer.Option(1, "--tp", min=1, help="Tensor-parallel size of the target (legacy: one file "
                   "per rank; mcore: sets the vocab padding and the stored args).")
_PP = typer.Option(1, "--pp", min=1, help="Pipeline-parallel size of the target.")
_VPP = typer.Option(None, "--vpp", min=1, help="Virtual pipeline stages per pipeline rank (legacy: "
                    "model0, model1, ... per file).")
_EP = typer.Option(1, "--ep", min=1, help="Expert-parallel size of the target.")
_ETP = typer.Option(None, "--etp", min=1, help="Expert tensor-parallel size (legacy: must equal "
                    "--tp).")
_DP = typer.Option(None, "--dp", min=1, help="--to trainer: data-parallel size of the target "
                   "(default: the saved number of ranks).")
_ZERO = typer.Option(None, "--zero", min=0, max=3, help="--to trainer: ZeRO stage of the target "
                     "(default: the saved one).")
_DTYPE = typer.Option(None, "--dtype", help="Cast floating tensors to bf16, fp16 or fp32 (default: "
                      "keep each tensor's dtype). fp8 weights are dequantized into it (default: "
                      "the checkpoint's dtype).")
_WORKERS = typer.Option("auto", "--workers", help="Worker processes writing output files in "
                        "parallel (megatron targets; each opens the source and reads ahead in a "
                        "thread while it writes); auto: one per two cores.")
_VERIFY = typer.Option(False, "--verify", help="Read every tensor of the result back and compare "
                       "it bit-exactly with the source (after --dtype).")
_OVERWRITE = typer.Option(False, "--overwrite", help="Replace an existing DST (only once the new "
                          "one is complete).")
_HF_CONFIG = typer.Option(None, "--hf-config", help="Folder with the model's config.json, for "
                          "Megatron/DeepSpeed checkpoints that do not carry one.")
_SOURCE_FORMAT = typer.Option(None, "--from", help="Source format when detection is ambiguous: hf, "
                              "mcore, megatron-legacy, deepspeed.")
_VOCAB_MULTIPLE = typer.Option(128, "--vocab-multiple", min=1, help="Megatron targets: pad the "
                               "vocab to a multiple of this x tp (Megatron-LM's "
                               "--make-vocab-size-divisible-by, default 128 as there; 1 = least "
                               "padding). HF output strips the padding.")
_MAX_SHARD_GB = typer.Option(5.0, "--max-shard-gb", help="HF target: largest safetensors shard, in "
                             "GiB.")
_FSYNC = typer.Option(False, "--fsync", help="fsync every output file before the final rename "
                      "(durable against power loss; slower).")
_QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar.")
_MERGE_LORA = typer.Option(False, "--merge-lora", help="--to hf of a LoRA / DoRA run (or an HF "
                           "PEFT folder): the base model with the adapters merged in float32, "
                           "saved in the base's dtype.")
_BASE = typer.Option(None, "--base", help="--merge-lora / hf-peft: the base HF folder (default: "
                     "the one the run recorded).")


def convert(
    src: Path = _SRC,
    dst: Path = _DST,
    to: str = _TO,
    tp: int = _TP,
    pp: int = _PP,
    vpp: int | None = _VPP,
    ep: int = _EP,
    etp: int | None = _ETP,
    dp: int | None = _DP,
    zero: int | None = _ZERO,
    dtype: str | None = _DTYPE,
    workers: str = _WORKERS,
    verify: bool = _VERIFY,
    overwrite: bool = _OVERWRITE,
    hf_config: Path | None = _HF_CONFIG,
    source_format: str | None = _SOURCE_FORMAT,
    vocab_multiple: int = _VOCAB_MULTIPLE,
    max_shard_gb: float = _MAX_SHARD_GB,
    fsync: bool = _FSYNC,
    quiet: bool = _QUIET,
    merge_lora: bool = _MERGE_LORA,
    base: Path | None = _BASE,
) -> None:
    """Convert a checkpoint to another format and layout, offline (no GPU, no process group).

    Reads only the tensor slices each output file needs, writes each output file as soon as it
    is complete, and holds about one output tensor (one rank file for megatron-legacy) in
    memory. A failed or interrupted conversion leaves no DST. Examples:

      mdtk convert ./Llama-3.2-1B ./ckpt --to mcore --tp 2 --pp 2

      mdtk convert ./ckpt ./legacy --to megatron-legacy --tp 2 --pp 2 --vpp 2

      mdtk convert ./run/checkpoints/step_0000100 ./hf --to hf --dtype bf16

      mdtk convert ./lora_run/checkpoints ./adapter --to hf-peft

      mdtk convert ./lora_run/checkpoints ./merged --to hf --merge-lora [--base ./Llama-3.2-1B]
    """
    if to == "hf-peft" or merge_lora or _has_adapter(src):
        _adapters(src, dst, to, merge_lora=merge_lora, base=base, overwrite=overwrite)
        return
    if to == "trainer":
        _to_trainer(src, dst, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, dp=dp, zero=zero,
                    overwrite=overwrite)
        return
    from toolkit.checkpoint import CheckpointError
    from toolkit.convert import convert as run_convert
    from toolkit.parallel.layout import LayoutError, ParallelLayout

    try:
        layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
        report = run_convert(src, dst, to, layout, dtype=dtype, workers=workers,
                             overwrite=overwrite, progress=not quiet,
                             source_format=source_format, hf_config=hf_config,
                             vocab_multiple=vocab_multiple, verify=verify,
                             max_shard_bytes=int(max_shard_gb * 2**30), fsync=fsync)
    except (CheckpointError, LayoutError, ValueError, FileNotFoundError) as err:
        errors.say(err)
        raise typer.Exit(2) from err
    for line in report.summary():
        typer.echo(line)


def _has_adapter(src: Path) -> bool:
    from toolkit.convert.adapters import is_adapter

    return is_adapter(src)


def _adapters(src: Path, dst: Path, to: str, *, merge_lora: bool, base: Path | None,
              overwrite: bool) -> None:
    """LoRA / DoRA adapters: an HF PEFT folder, or merged into their base (``--merge-lora``)."""
    from toolkit.convert import adapters
    from toolkit.errors import UserError

    try:
        if to == "hf-peft" and not merge_lora:
            out = adapters.to_peft(src, dst, base=str(base) if base else None,
                                   overwrite=overwrite)
        elif to == "hf" and merge_lora:
            out = adapters.merge(src, dst, base=str(base) if base else None, overwrite=overwrite)
        else:
            how = ("--merge-lora writes an HF model: use --to hf --merge-lora" if merge_lora else
                   f"{src} holds LoRA adapters, not a full model: use --to hf-peft (the "
                   "adapters) or --to hf --merge-lora (merged into the base)")
            raise UserError(how + ".")
    except UserError as err:
        errors.say(err)
        raise typer.Exit(2) from err
    typer.echo(f"{'merged model' if merge_lora else 'HF PEFT adapter'} -> {out}")


def _to_trainer(src: Path, dst: Path, **layout) -> None:
    """A trainer checkpoint resharded to another layout (``toolkit.train.checkpoints.reshard``)."""
    from toolkit.errors import UserError
    from toolkit.runtime.rankpool import RankFailure
    from toolkit.train.checkpoints.relayout import convert_checkpoint

    try:
        out = convert_checkpoint(src, dst, **layout)
    except (UserError, RankFailure) as err:
        errors.say(err)
        raise typer.Exit(2) from err
    typer.echo(f"trainer checkpoint -> {out} (resume with checkpoint.dir={dst} "
               "checkpoint.resume=auto at the new layout)")


def inspect(
    path: Path = typer.Argument(..., help="A checkpoint folder of any supported format, or a "
                                "Megatron indexed dataset (PREFIX of PREFIX.bin/.idx)."),
    hf_config: Path | None = typer.Option(None, "--hf-config", help="Folder with config.json "
                                          "for checkpoints that carry none."),
    source_format: str | None = typer.Option(None, "--from", help="Format, when detection is "
                                             "ambiguous."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Describe a checkpoint: format, architecture, layout, dtypes, parameter count, files, and
    the consistency problems found (missing or truncated files, shapes that differ from
    config.json, missing ranks; for a trainer checkpoint, files whose size or xxh3-128 checksum
    differs from its manifest). For an indexed dataset PREFIX: documents, sequences, tokens,
    dtype, the largest token id and whose dtype codes the index uses (megatron-core or
    DeepSpeed). Exit 1 when there are problems."""
    import dataclasses
    import json

    from toolkit.train.data.indexed_format import looks_indexed

    if looks_indexed(str(path)):
        _inspect_indexed(str(path), as_json)
        return
    from toolkit.convert import inspect as run_inspect

    info = run_inspect(path, hf_config=hf_config, source_format=source_format)
    if as_json:
        data = dataclasses.asdict(info)
        data["path"] = str(info.path)
        typer.echo(json.dumps(data, indent=1))
    else:
        typer.echo(f"path:         {info.path}")
        typer.echo(f"format:       {info.format or 'unknown'}")
        if info.architecture:
            typer.echo(f"architecture: {info.architecture}")
        if info.adapter:
            a = info.adapter
            typer.echo(f"adapter:      {a['method']} r={a['r']} alpha={a['alpha']:g}"
                       + (" rslora" if a["rslora"] else "") + f", {a['modules']} modules, "
                       f"{a['parameters']:,} parameters")
            typer.echo(f"targets:      {', '.join(a['targets'])}")
            typer.echo(f"base:         {a['base'] or 'not recorded'}")
        if info.iteration is not None:
            typer.echo(f"iteration:    {info.iteration}")
        if info.layout:
            typer.echo("layout:       " + " ".join(f"{k}={v}" for k, v in info.layout.items()))
        if info.dtypes:
            typer.echo("dtypes:       " + ", ".join(f"{k} ({v} tensors)"
                                                   for k, v in info.dtypes.items()))
        if info.quantization:
            typer.echo(f"quantized:    {info.quantization}")
        if info.tensors:
            typer.echo(f"parameters:   {info.parameters:,} in {info.tensors} tensors")
        if info.manifest:
            typer.echo(f"manifest:     {info.manifest}")
        typer.echo(f"files:        {len(info.files)}")
        for f in info.files[:20]:
            typer.echo(f"  {f}")
        if len(info.files) > 20:
            typer.echo(f"  ... ({len(info.files) - 20} more)")
        if info.problems:
            typer.echo("problems:")
            for p in info.problems:
                typer.echo(f"  - {p}")
        else:
            typer.echo("problems:     none found")
    if info.problems:
        raise typer.Exit(1)


def _inspect_indexed(prefix: str, as_json: bool) -> None:
    """A Megatron indexed dataset: which writer's dtype codes, dtype, documents, tokens, the
    largest token id (a scan of the .bin); a file the trainer would refuse: exit 1."""
    import json

    from toolkit.train.data.indexed_format import describe

    d = describe(prefix)
    if as_json:
        typer.echo(json.dumps(d, indent=1))
    else:
        for key, value in d.items():
            if key != "problems":
                typer.echo(f"{key + ':':14s}{value:,}" if isinstance(value, int)
                           else f"{key + ':':14s}{value}")
        typer.echo("problems:" + "".join(f"\n  - {p}" for p in d["problems"])
                   if d["problems"] else "problems:     none found")
    if d["problems"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)
    app.command("inspect")(inspect)
