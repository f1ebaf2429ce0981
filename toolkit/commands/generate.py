"""``mdtk generate MODEL --prompts FILE --out FILE`` and ``mdtk eval MODEL --tasks T --out FILE``:
on every rank of a launch (``mdtk launch -n N -- generate ...``, torchrun, srun) or as one plain
process."""

from __future__ import annotations

import typer

from toolkit.commands.options import EP, PP, TP

MODEL = typer.Argument(..., help="An HF folder or hub id, a megatron-core / legacy Megatron "
                       "checkpoint (any layout), a `mdtk train` checkpoint (step folder or "
                       "checkpoint root; LoRA adapters are applied on their base), or an HF PEFT "
                       "folder.")
TOKENIZER = typer.Option(None, "--tokenizer", help="Tokenizer folder or hub id (default: the "
                         "model's, or the one a checkpoint's hf_config/ carries).")
DTYPE = typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (default: the model's).")
BATCH = typer.Option(8, "--batch-size", min=1, help="Prompts (or lm-eval requests) per batch.")


def generate(
    model: str = MODEL,
    prompts: str = typer.Option(..., "--prompts", help="JSON lines: 'prompt' (text) or "
                                "'messages' (a chat, rendered with the tokenizer's template)."),
    out: str = typer.Option(..., "--out", help="JSON lines written here, one per prompt in "
                            "order: prompt, completion, completion_ids, finish_reason."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", help="0 (the default): greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling (1: off)."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k sampling (0: off; not with --top-p)."),
    seed: int = typer.Option(1234, "--seed", help="Sampling seed: the same tokens at any layout."),
    tp: int = TP, pp: int = PP, ep: int = EP,
    batch_size: int = BATCH, tokenizer: str = TOKENIZER, dtype: str = DTYPE,
) -> None:
    """Generate completions with megatron-core's inference engine on the sharded model (static
    batches, KV cache), at the layout --tp/--pp/--ep over the launch's ranks. Greedy output
    equals transformers' generate token for token."""
    from toolkit.infer.engine import Sampling
    from toolkit.infer.run import Request
    from toolkit.infer.run import generate as run
    from toolkit.parallel import ParallelLayout

    req = Request(model, out, ParallelLayout(tp=tp, pp=pp, ep=ep), tokenizer, dtype, batch_size)
    n = run(req, prompts, Sampling(max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_p=top_p, top_k=top_k, seed=seed))
    _rank0(f"wrote {n} completions to {out}")


def evaluate(
    model: str = MODEL,
    tasks: str = typer.Option(..., "--tasks", help="Comma-separated lm-eval tasks (its registry "
                              "or YAMLs under --include-path)."),
    out: str = typer.Option(..., "--out", help="lm-eval's results JSON (results[task][metric])."),
    include_path: str = typer.Option(None, "--include-path", help="A folder of lm-eval task "
                                     "YAMLs (e.g. bundled:examples/eval)."),
    num_fewshot: int = typer.Option(None, "--num-fewshot", min=0),
    limit: int = typer.Option(None, "--limit", min=1, help="At most this many documents per "
                              "task."),
    tp: int = TP, pp: int = PP, ep: int = EP,
    batch_size: int = BATCH, tokenizer: str = TOKENIZER, dtype: str = DTYPE,
) -> None:
    """Score lm-evaluation-harness tasks on the sharded model (log-likelihoods and generation on
    megatron-core, requests built as lm-eval's `hf` model builds them)."""
    from toolkit.infer.run import Request, metric_names
    from toolkit.infer.run import evaluate as run
    from toolkit.parallel import ParallelLayout

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    req = Request(model, out, ParallelLayout(tp=tp, pp=pp, ep=ep), tokenizer, dtype, batch_size)
    results = run(req, names, include_path=include_path, num_fewshot=num_fewshot, limit=limit)
    if results is not None:
        for task, metrics in results["results"].items():
            shown = ", ".join(f"{k.split(',')[0]} {metrics[k]:.4g}"
                              for k in metric_names(results, task))
            typer.echo(f"{task}: {shown}")
        typer.echo(f"wrote {out}")


def _rank0(text: str) -> None:
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        typer.echo(text)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
    app.command("eval")(evaluate)
