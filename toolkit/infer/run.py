"""``mdtk generate`` and ``mdtk eval`` on every rank of a launch (or as one plain process): the
request checked before any model is loaded (files, sampling, tasks, the layout against the
world), then the model at the layout, then the work; rank 0 writes the output file, atomically
(nothing is written when anything fails)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from toolkit.errors import UserError
from toolkit.infer.engine import GenerationError, Sampling
from toolkit.parallel import ParallelLayout


@dataclass(frozen=True)
class Request:
    """What to load and where the result goes (both commands)."""

    model: str
    out: str
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    tokenizer: str | None = None
    dtype: str | None = None  # bf16 | fp16 | fp32 (default: the model's)
    batch_size: int = 8


def check_out(out: str) -> Path:
    """The output file's place, refused when it cannot be written (before any work)."""
    path = Path(out)
    if path.is_dir():
        raise UserError(f"--out {out} is a folder: give a file path.")
    if not path.parent.exists():
        raise UserError(f"--out {out}: the folder {path.parent} does not exist.")
    return path


def _world_layout(layout: ParallelLayout) -> ParallelLayout:
    """``layout`` resolved against the launch's world; a layout the world cannot fill says how
    to start the ranks it needs."""
    import torch.distributed as dist

    from toolkit.parallel import LayoutError

    world = dist.get_world_size()
    try:
        return layout.resolve(world)
    except LayoutError as e:
        need = layout.tp * layout.pp * layout.cp
        raise UserError(f"{e} This launch has {world} rank(s); start {need} or a multiple: "
                        f"`mdtk launch -n {need} -- generate ...` (or eval).") from None


def _load(req: Request) -> Any:
    from toolkit import parallel
    from toolkit.checkpoint.torchfree.dtypes import PRECISIONS
    from toolkit.infer.load import load

    layout = _world_layout(req.layout)
    parallel.initialize(layout)
    dtype = PRECISIONS[req.dtype].torch if req.dtype else None
    return load(req.model, layout, dtype=dtype, tokenizer=req.tokenizer)


def generate(req: Request, prompts_file: str, sampling: Sampling) -> int:
    """The completions of every prompt in ``prompts_file``, one JSON line each (input order), in
    ``req.out``; returns the number of prompts."""
    import torch.distributed as dist

    from toolkit import parallel, runtime
    from toolkit.atomic import write_text
    from toolkit.infer.engine import Generator
    from toolkit.infer.prompts import output_row, read_prompts

    out = check_out(req.out)
    sampling.check()
    runtime.enable_cpu_mode()
    with runtime.joined():
        try:
            with runtime.failing_together():
                loaded = _load(req)
                prompts = read_prompts(prompts_file, loaded.tokenizer)
                _check_lengths(prompts, sampling, loaded.max_positions, prompts_file)
            longest = max(len(p.ids) for p in prompts) + sampling.max_new_tokens
            gen = Generator(loaded.chunks, eos_ids=loaded.eos_ids,
                            vocab_size=loaded.adapter.dims.vocab, max_seq_len=longest,
                            max_batch=req.batch_size, decode=loaded.tokenizer.decode)
            rows: list[dict] = []
            with _bar(len(prompts), dist.get_rank() == 0) as advance, no_progress_bars():
                for start in range(0, len(prompts), req.batch_size):
                    batch = prompts[start:start + req.batch_size]
                    done = gen.generate([p.ids for p in batch], sampling)
                    rows += [output_row(p, c.completion_ids, c.finish_reason, loaded.tokenizer)
                             for p, c in zip(batch, done, strict=True)]
                    advance(len(batch))
            if dist.get_rank() == 0:
                write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
            dist.barrier()
            return len(rows)
        finally:
            parallel.destroy()


@contextmanager
def _bar(total: int, shown: bool) -> Iterator[Any]:
    """One titled bar over the prompts on rank 0 (megatron-core's own, one per batch and rank,
    are off): yields ``advance(n)``."""
    if not shown:
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("prompts"), transient=False)
    task = bar.add_task("generate", total=total)
    with bar:
        yield lambda n: bar.advance(task, n)


def _check_lengths(prompts: list, sampling: Sampling, limit: int, where: str) -> None:
    for p in prompts:
        if len(p.ids) + sampling.max_new_tokens > limit:
            raise GenerationError(
                f"{where}:{p.line}: the prompt has {len(p.ids)} tokens; with --max-new-tokens "
                f"{sampling.max_new_tokens} it needs {len(p.ids) + sampling.max_new_tokens} "
                f"positions, the model takes {limit} (max_position_embeddings). Shorten it or "
                "lower --max-new-tokens.")


def check_tasks(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's task manager with ``include_path``; UserError naming unknown tasks (before
    anything is loaded). The same request gives the same manager (a training run checks its
    config, then its eval section builds on it: one index, not two)."""
    return _task_manager(tuple(tasks), include_path)


@lru_cache(maxsize=4)
def _task_manager(tasks: tuple[str, ...], include_path: str | None) -> Any:
    from lm_eval.tasks import TaskManager

    from toolkit import bundled

    if include_path is not None:
        include_path = bundled.resolve(include_path)
        if not Path(include_path).is_dir():
            raise UserError(f"--include-path {include_path} is not a folder of task YAMLs.")
        # local tasks only: no index of lm-eval's registry (~6 s)
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(manager.all_tasks):
            return manager
    manager = TaskManager(include_path=include_path)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise UserError(f"unknown lm-eval task(s) {', '.join(unknown)}: not in lm-eval's "
                        "registry" + (f" nor under {include_path}" if include_path else "")
                        + " (`lm_eval --tasks list` lists them; --include-path adds a folder of "
                        "task YAMLs).")
    return manager


def evaluate(req: Request, tasks: list[str], *, include_path: str | None = None,
             num_fewshot: int | None = None, limit: int | None = None) -> dict | None:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on the sharded model; rank 0 writes lm-eval's
    results JSON to ``req.out`` and returns it (other ranks: None)."""
    import torch.distributed as dist

    from toolkit import parallel, runtime
    from toolkit.atomic import write_text

    out = check_out(req.out)
    manager = check_tasks(tasks, include_path)
    runtime.enable_cpu_mode()
    with runtime.joined():
        try:
            with runtime.failing_together():
                loaded = _load(req)
            # lm-eval's bars on rank 0 only (every rank runs every request)
            with nullcontext() if dist.get_rank() == 0 else no_progress_bars():
                results = run_tasks(loaded, tasks, manager, num_fewshot=num_fewshot,
                                    limit=limit, batch_size=req.batch_size)
            if dist.get_rank() == 0:
                write_text(out, json.dumps(results, indent=1, default=str))
            dist.barrier()
            return results if dist.get_rank() == 0 else None
        finally:
            parallel.destroy()


def run_tasks(loaded: Any, tasks: list[str], manager: Any, *, num_fewshot: int | None = None,
              limit: int | None = None, batch_size: int = 8) -> dict | None:
    """lm-eval's results (``results[task][metric]``, its configs and versions; no samples) of
    ``tasks`` on ``loaded``'s chunks; None on ranks other than 0."""
    import logging

    import lm_eval

    from toolkit.infer.engine import Generator, megatron_quiet
    from toolkit.infer.lm import ShardedLM

    spec = loaded.spec
    generator = Generator(loaded.chunks, eos_ids=loaded.eos_ids,
                          vocab_size=loaded.adapter.dims.vocab,
                          max_seq_len=loaded.max_positions, max_batch=1,
                          decode=loaded.tokenizer.decode)
    lm = ShardedLM(loaded.chunks, loaded.tokenizer, spec.transformers_config(),
                   vocab_size=loaded.adapter.dims.vocab, generator=generator,
                   batch_size=batch_size)
    for name in ("lm_eval", "lm-eval"):  # its per-run INFO/WARNING lines drown the run's log
        logging.getLogger(name).setLevel(logging.ERROR)
    with megatron_quiet(), _no_git_hash():
        res = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot,
                                      limit=limit, task_manager=manager)
    if res is None:
        return None
    return {k: res[k] for k in ("results", "configs", "versions", "n-shot", "higher_is_better")
            if k in res}


@contextmanager
def _no_git_hash() -> Iterator[None]:
    """lm-eval records the git hash of the current folder by running ``git describe``, whose
    "fatal: not a git repository" reaches the terminal outside a checkout; the hash says nothing
    about an mdtk model, so the results hold None."""
    import lm_eval.evaluator as evaluator

    lookup = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = lookup


def metric_names(results: dict, task: str) -> list[str]:
    """The metric keys (``acc,none``) of ``task`` in lm-eval's results: those its
    ``higher_is_better`` names (not stderrs, aliases or counts)."""
    known = results.get("higher_is_better", {}).get(task, {})
    return [k for k, v in results["results"][task].items()
            if k.split(",")[0] in known and isinstance(v, (int, float))]


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """tqdm bars off (lm-eval's per-task bars, the static engine's), even where the caller
    passes ``disable=False``: a training run's log shows the eval's results, not a dozen bars
    every interval."""
    from tqdm.std import tqdm

    init = tqdm.__init__

    def quiet(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    tqdm.__init__ = quiet
    try:
        yield
    finally:
        tqdm.__init__ = init
