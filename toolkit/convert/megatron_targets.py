"""The megatron targets: a torch_dist checkpoint (``mcore``) or legacy rank files.

Either is written into a temporary sibling folder (``building``) with the tracker file Megatron-LM
reads, the model's HF config (``hf_config/``) and the run arguments; the data files are split
into jobs of about equal bytes (``pool``), each writing its files from the source through the
adapter's mapping table, so one output tensor (one rank file for legacy) is in memory at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkit.atomic import building
from toolkit.checkpoint import (
    CheckpointError,
    mcore_dist_writer,
    megatron_layout,
    megatron_legacy,
    megatron_meta,
)
from toolkit.checkpoint.hf import TOKENIZER_FILES
from toolkit.convert.extras import save_kept
from toolkit.convert.pool import job_source, run_jobs, split
from toolkit.convert.progress import Progress
from toolkit.convert.sources import Ctx, Opened
from toolkit.lazy import torch
from toolkit.parallel.layout import ParallelLayout


def _mcore_job(dtype: torch.dtype | None, layout: ParallelLayout, folder: str, index: int,
               items: list[mcore_dist_writer.Item], tick: Callable[[int], None] | None = None
               ) -> list[dict]:
    op = job_source()
    return mcore_dist_writer.write_data_file(Path(folder) / f"__{index}_0.distcp", items,
                                             op.adapter.table(layout.tp), op.read,
                                             op.dtype_of(dtype), tick or (lambda n: None),
                                             op.byte_range)


def _legacy_job(dtype: torch.dtype | None, layout: ParallelLayout, folder: str,
                coords: list[Any], extra: dict, tick: Callable[[int], None] | None = None
                ) -> list[str]:
    op = job_source()
    table = op.adapter.table(layout.tp)
    return [str(megatron_legacy.write_rank_file(Path(folder), c, table, op.read,
                                                op.dtype_of(dtype), extra,
                                                tick or (lambda n: None)))
            for c in coords]


def write_megatron(ctx: Ctx, op: Opened, to: str, dst: Path, layout: ParallelLayout,
                   dtype: torch.dtype | None, workers: int, overwrite: bool, bar: Progress,
                   fsync: bool = False) -> None:
    """Write ``to`` (``mcore`` or ``megatron-legacy``) at ``dst`` from the open source."""
    adapter = op.adapter
    dtype_of = op.dtype_of(dtype)
    iteration = op.info.get("iteration")
    with building(dst) as tmp:
        folder = megatron_layout.write_tracker(tmp, iteration)
        out_dtype = dtype or dtype_of(next(iter(adapter.expected_tensors())))
        megatron_layout.write_hf_config(tmp, lambda d: op.spec.write(d, out_dtype),
                                        [adapter.source] if adapter.source else [])
        save_kept(op, tmp / megatron_layout.HF_CONFIG_DIR, dtype)  # e.g. DeepSeek-V3's MTP layers
        padded = adapter.padded_vocab(layout.tp)
        # the tokenizer files copied into hf_config/, named by their final (absolute) path
        has_tok = any((tmp / megatron_layout.HF_CONFIG_DIR / n).is_file() for n in TOKENIZER_FILES)
        tok = str(dst.resolve() / megatron_layout.HF_CONFIG_DIR) if has_tok else None
        args = megatron_meta.megatron_args(adapter, layout, padded, iteration,
                                        "torch_dist" if to == "mcore" else "torch", out_dtype,
                                        tokenizer_model=tok)
        common = {"args": args, "checkpoint_version": megatron_meta.CHECKPOINT_VERSION,
                  "iteration": iteration or 0,
                  "num_floating_point_operations_so_far": int(
                      op.info.get("num_floating_point_operations_so_far") or 0)}
        if to == "mcore":
            common["content_metadata"] = dict(megatron_meta.CONTENT_METADATA)
        if to == "mcore":
            items = mcore_dist_writer.plan_items(adapter, layout.tp, dtype_of)
            groups = split(items, [it.nbytes for it in items], workers)
            jobs = [(ctx.dtype, layout, str(folder), i, g) for i, g in enumerate(groups)]
            results = run_jobs(_mcore_job, jobs, workers, bar.advance,
                               [sum(it.nbytes for it in g) for g in groups], ctx)
            records = [r for rs in results for r in rs]
            mcore_dist_writer.write_metadata(folder, items, records, adapter.dims.layers,
                                      adapter.dims.experts, common)
        else:
            coords = megatron_legacy.rank_coords(layout.tp, layout.pp, layout.vpp or 1,
                                                 layout.ep)
            table = adapter.table(layout.tp)
            sizes = [megatron_legacy.rank_bytes(table, c, dtype_of) for c in coords]
            bar.set_total(sum(sizes))
            groups = split(list(range(len(coords))), sizes, workers)
            jobs = [(ctx.dtype, layout, str(folder), [coords[i] for i in g], common)
                    for g in groups]
            run_jobs(_legacy_job, jobs, workers, bar.advance,
                     [sum(sizes[i] for i in g) for g in groups], ctx)
        if fsync:
            _fsync_tree(tmp)
        if dst.exists() and not overwrite:
            raise CheckpointError(f"{dst} appeared while converting; not overwriting it.")


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
