"""Offline checkpoint conversion: any supported format to any other, at any target layout.

A *source* is anything with the HF reader interface (``names``, ``shape``, ``dtype``,
``read(name, region)``, ``close``): ``HFReader`` for HF folders, ``McoreFullSource`` over the
megatron-side readers. Writers pull exactly the regions each output tensor needs, through the
adapter's mapping table and ``plan_rank``, so one output tensor (or one legacy rank file) is in
memory at a time and nothing depends on a process group or a GPU.

Sources are pluggable: ``register_source(name, open_fn, looks_like)`` adds a format
(``SOURCES[name](path, hf_config=None) -> (source, hf_config, info)``; ``info`` is a dict with
optional keys ``hf_dir``, ``iteration``, ``layout``, ``files``). Outputs are written into a
temporary sibling folder and renamed into place at the end.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from toolkit.adapters import CheckpointMismatch, adapter_for, load_hf_config
from toolkit.atomic import building
from toolkit.checkpoint import detect as detect_mod
from toolkit.checkpoint import mcore_dist, megatron_legacy
from toolkit.checkpoint.hf import CheckpointError, HFReader, HFWriter
from toolkit.parallel.layout import ParallelLayout

TARGETS = ("hf", "mcore", "megatron-legacy")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SOURCES: dict[str, Callable[..., tuple[Any, Any, dict]]] = {}
#: Modules that register further source formats when imported (if present).
PLUGINS = ("toolkit.checkpoint.deepspeed",)


def register_source(name: str, open_fn: Callable[..., tuple[Any, Any, dict]],
                    looks_like: Callable[[Path], bool]) -> None:
    """Add a source format: ``open_fn(path, hf_config=None)`` and its detector."""
    SOURCES[name] = open_fn
    detect_mod.LOOKS_LIKE[name] = looks_like


def _load_plugins() -> None:
    for name in PLUGINS:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


# -- built-in sources -----------------------------------------------------------------------------

def _open_hf(path: Path, hf_config: Path | None = None) -> tuple[Any, Any, dict]:
    reader = HFReader(path)
    files = sorted(set(reader.files.values()))
    return reader, load_hf_config(hf_config or path), {"hf_dir": Path(hf_config or path),
                                                       "files": files}


def adapter_factory(override: Path | None) -> Callable[[Path | None, dict], Any]:
    """For Megatron-side sources: ``make(found_hf_dir, common)`` builds the adapter from the
    checkpoint's own ``hf_config/`` folder, or from ``override`` (``--hf-config``)."""
    def make(found: Path | None, common: dict) -> Any:
        folder = override or found
        if folder is None:
            raise CheckpointError("this Megatron checkpoint carries no HF config (no hf_config/ "
                                  "folder): pass --hf-config DIR, a folder with the model's "
                                  "config.json.")
        return adapter_for(folder)
    return make


def _layout_from_args(args: Any) -> dict[str, Any]:
    keys = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
            "vpp": "virtual_pipeline_model_parallel_size", "ep": "expert_model_parallel_size"}
    return {k: getattr(args, v, None) for k, v in keys.items()} if args is not None else {}


def _open_mcore(path: Path, hf_config: Path | None = None) -> tuple[Any, Any, dict]:
    source, ckpt = mcore_dist.open_source(path, adapter_factory(hf_config))
    return source, source.hf_config, {
        "hf_dir": source.adapter.source, "iteration": ckpt.iteration, "folder": ckpt.path,
        "layout": _layout_from_args(ckpt.common.get("args")),
        "files": sorted(p.name for p in ckpt.path.iterdir())}


def _open_legacy(path: Path, hf_config: Path | None = None) -> tuple[Any, Any, dict]:
    source, ckpt = megatron_legacy.open_source(path, adapter_factory(hf_config))
    return source, source.hf_config, {
        "hf_dir": source.adapter.source, "iteration": ckpt.iteration, "folder": ckpt.path,
        "layout": {"tp": ckpt.tp, "pp": ckpt.pp, "vpp": ckpt.vpp if ckpt.vpp > 1 else None,
                   "ep": ckpt.ep},
        "files": sorted(str(f.relative_to(ckpt.path)) for f in ckpt.files.values())}


register_source("hf", _open_hf, detect_mod.looks_like_hf)
register_source(mcore_dist.FORMAT, _open_mcore, mcore_dist.looks_like)
register_source(megatron_legacy.FORMAT, _open_legacy, megatron_legacy.looks_like)


def detect(path: str | Path) -> str:
    _load_plugins()
    return detect_mod.detect(path)


# -- the conversion -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Ctx:
    """What a worker process needs to reopen the source (picklable)."""

    fmt: str
    src: str
    hf_config: str | None
    dtype: torch.dtype | None
    vocab_multiple: int


@dataclass
class _Opened:
    source: Any
    adapter: Any
    info: dict
    names: dict[str, str]  # expected HF name -> stored name

    def read(self, name: str, region: Any) -> torch.Tensor:
        return self.source.read(self.names[name], tuple(region))

    def dtype_of(self, dtype: torch.dtype | None) -> Callable[[str], torch.dtype]:
        def of(name: str) -> torch.dtype:
            stored = self.source.dtype(self.names[name])
            return dtype if dtype is not None and stored.is_floating_point else stored
        return of


def _open(ctx: _Ctx) -> _Opened:
    _load_plugins()
    if ctx.fmt not in SOURCES:
        raise CheckpointError(f"unknown source format {ctx.fmt!r}; known: {sorted(SOURCES)}.")
    kwargs = {"hf_config": Path(ctx.hf_config)} if ctx.hf_config else {}
    source, hf_config, info = SOURCES[ctx.fmt](Path(ctx.src), **kwargs)
    try:
        adapter = adapter_for(hf_config, vocab_multiple=ctx.vocab_multiple)
        adapter.source = info.get("hf_dir")
        stored = {n: tuple(source.shape(n)) for n in source.names}
        try:
            names = adapter.match_checkpoint(stored)
        except CheckpointMismatch as err:
            raise CheckpointError(f"{ctx.src}: {err}{_where(source, adapter, stored)}") from err
    except BaseException:
        source.close()
        raise
    return _Opened(source, adapter, info, names)


def open_checkpoint(path: str | Path, hf_config: str | Path | None = None,
                    fmt: str | None = None) -> _Opened:
    """Any supported checkpoint folder as HF-named tensors: ``.read(name, region)``,
    ``.adapter``, ``.info``, ``.source`` (close it when done). ``fmt`` defaults to detection."""
    path = Path(path)
    return _open(_Ctx(fmt or detect(path), str(path), str(hf_config) if hf_config else None,
                      None, 1))


def _where(source: Any, adapter: Any, stored: dict[str, tuple[int, ...]]) -> str:
    """`` (in FILE, ...)``: the files holding tensors whose shapes differ from config.json."""
    locate = getattr(source, "locate", None)
    if locate is None:
        return ""
    prefix = adapter.family.base_prefix
    files = []
    for name, shape in adapter.expected_tensors().items():
        bare = name[len(prefix):] if prefix and name.startswith(prefix) else name
        key = name if name in stored else bare
        if key in stored and tuple(stored[key]) != tuple(shape):
            f = str(locate(key))
            if f not in files:
                files.append(f)
    return f" (in {', '.join(files[:4])})" if files else ""


@dataclass
class Report:
    src: Path
    dst: Path
    source_format: str
    target: str
    layout: ParallelLayout
    tensors: int
    bytes: int
    seconds: float
    files: list[str] = field(default_factory=list)
    verified: int = 0  # tensors read back from dst and compared bit-exactly (--verify)


def _full(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


#: The source opened by ``convert`` in this process (jobs run here reuse it; workers open
#: their own).
_IN_PROCESS: dict[_Ctx, _Opened] = {}


def _job_source(ctx: _Ctx) -> tuple[_Opened, bool]:
    if ctx in _IN_PROCESS:
        return _IN_PROCESS[ctx], False
    return _open(ctx), True


def _mcore_job(ctx: _Ctx, layout: ParallelLayout, folder: str, index: int,
               items: list[mcore_dist.Item], tick: Callable[[int], None] | None = None
               ) -> list[dict]:
    op, own = _job_source(ctx)
    try:
        return mcore_dist.write_data_file(Path(folder) / f"__{index}_0.distcp", items,
                                          op.adapter.table(layout.tp), op.read,
                                          op.dtype_of(ctx.dtype), tick or (lambda n: None))
    finally:
        if own:
            op.source.close()


def _legacy_job(ctx: _Ctx, layout: ParallelLayout, folder: str, coords: list[Any],
                extra: dict, tick: Callable[[int], None] | None = None) -> list[str]:
    op, own = _job_source(ctx)
    try:
        table = op.adapter.table(layout.tp)
        return [str(megatron_legacy.write_rank_file(Path(folder), c, table, op.read,
                                                    op.dtype_of(ctx.dtype), extra,
                                                    tick or (lambda n: None)))
                for c in coords]
    finally:
        if own:
            op.source.close()


def _split(items: list[Any], weights: list[int], n: int) -> list[list[Any]]:
    """Greedy balance by weight into at most n non-empty groups (order kept inside a group)."""
    groups: list[list[Any]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(items)), key=lambda i: -weights[i]):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += weights[i]
    return [[items[i] for i in sorted(g)] for g in groups if g]


def _run_jobs(fn: Callable, jobs: list[tuple], workers: int, tick: Callable[[int], None],
              sizes: list[int]) -> list[Any]:
    """Run ``fn(*job)`` for each job, in this process (fine-grained progress) or in workers."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(*job, tick) for job in jobs]
    results: list[Any] = [None] * len(jobs)
    with cf.ProcessPoolExecutor(max_workers=workers,
                                mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(fn, *job): i for i, job in enumerate(jobs)}
        for fut in cf.as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            tick(sizes[i])
    return results


def convert(
    src: str | Path,
    dst: str | Path,
    to: str,
    layout: ParallelLayout | None = None,
    dtype: torch.dtype | str | None = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    *,
    source_format: str | None = None,
    hf_config: str | Path | None = None,
    vocab_multiple: int = 1,
    verify: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    fsync: bool = False,
) -> Report:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst`` (layout for Megatron).

    ``layout``: tp/pp/vpp/ep of a megatron-legacy target (one file per rank); for mcore only
    tp matters (vocab padding: ``vocab_multiple * tp``); ignored for hf. ``dtype`` casts
    floating tensors (default: keep each tensor's dtype). ``verify`` reads every tensor of the
    result back and compares it bit-exactly with the source. ``fsync``: flush every output file
    to disk before the rename (durable against power loss; off by default, as ``cp`` and
    ``torch.save`` do).
    """
    start = time.perf_counter()
    if to not in TARGETS:
        raise ValueError(f"--to {to!r}: choose one of {', '.join(TARGETS)}.")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}.")
        dtype = DTYPES[dtype]
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be >= 1.")
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if dst == src or src in dst.parents:
        raise ValueError(f"destination {dst} is inside the source {src}: choose another folder.")
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} exists: choose a new folder or pass --overwrite.")
    layout = layout or ParallelLayout()
    fmt = source_format or detect(src)
    ctx = _Ctx(fmt, str(src), str(hf_config) if hf_config else None, dtype, vocab_multiple)
    op = _open(ctx)
    _IN_PROCESS[ctx] = op
    try:
        adapter = op.adapter
        adapter.validate(layout)
        if to == "megatron-legacy" and layout.etp not in (None, layout.tp):
            raise ValueError(f"--etp {layout.etp}: the legacy format supports expert-TP equal "
                             f"to tp ({layout.tp}) only.")
        dtype_of = op.dtype_of(dtype)
        expected = adapter.expected_tensors()
        total = sum(_numel(s) * dtype_of(n).itemsize for n, s in expected.items())
        with _Progress(progress, total, f"{fmt} -> {to}") as bar:
            if to == "hf":
                out_dtype = dtype or dtype_of(next(iter(expected)))
                writer = HFWriter(dst, overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                                  plan={n: (tuple(s), dtype_of(n)) for n, s in expected.items()})
                writer.fsync = fsync
                try:
                    for name, shape in expected.items():
                        writer.add(name, op.read(name, _full(shape)).to(dtype_of(name)))
                        bar.advance(_numel(shape) * dtype_of(name).itemsize)
                    from toolkit.adapters.live import generation_config

                    writer.finish(adapter.export_config(out_dtype),
                                  generation_config=generation_config(adapter),
                                  copy_from=adapter.source)
                except BaseException:
                    writer.abort()
                    raise
            else:
                _write_megatron(ctx, op, to, dst, layout, dtype, dtype_of, workers, overwrite,
                                bar, fsync)
    finally:
        _IN_PROCESS.pop(ctx, None)
        op.source.close()
    report = Report(src, dst, fmt, to, layout, len(expected), total,
                    0.0, sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()))
    if verify:
        report.verified = verify_conversion(ctx, dst, to, dtype)
    report.seconds = time.perf_counter() - start
    return report


def _write_megatron(ctx: _Ctx, op: _Opened, to: str, dst: Path, layout: ParallelLayout,
                    dtype: torch.dtype | None, dtype_of: Callable, workers: int,
                    overwrite: bool, bar: Any, fsync: bool = False) -> None:
    adapter = op.adapter
    iteration = op.info.get("iteration")
    with building(dst) as tmp:
        folder = mcore_dist.write_tracker(tmp, iteration)
        out_dtype = dtype or dtype_of(next(iter(adapter.expected_tensors())))
        mcore_dist.save_hf_config(adapter, tmp, out_dtype)
        padded = adapter.padded_vocab(layout.tp)
        args = mcore_dist.megatron_args(adapter, layout, padded, iteration,
                                        "torch_dist" if to == "mcore" else "torch", out_dtype)
        common = {"args": args, "checkpoint_version": mcore_dist.CHECKPOINT_VERSION,
                  "iteration": iteration or 0}
        if to == "mcore":
            items = mcore_dist.plan_items(adapter, layout.tp, dtype_of)
            groups = _split(items, [it.nbytes for it in items], workers)
            jobs = [(ctx, layout, str(folder), i, g) for i, g in enumerate(groups)]
            results = _run_jobs(_mcore_job, jobs, workers, bar.advance,
                                [sum(it.nbytes for it in g) for g in groups])
            records = [r for rs in results for r in rs]
            mcore_dist.write_metadata(folder, items, records, adapter.dims.layers,
                                      adapter.dims.experts, common)
        else:
            coords = megatron_legacy.rank_coords(layout.tp, layout.pp, layout.vpp or 1,
                                                 layout.ep)
            table = adapter.table(layout.tp)
            sizes = [megatron_legacy.rank_bytes(table, c, dtype_of) for c in coords]
            bar.set_total(sum(sizes))
            groups = _split(list(range(len(coords))), sizes, workers)
            jobs = [(ctx, layout, str(folder), [coords[i] for i in g], common) for g in groups]
            _run_jobs(_legacy_job, jobs, workers, bar.advance,
                      [sum(sizes[i] for i in g) for g in groups])
        if fsync:
            _fsync_tree(tmp)
        if dst.exists() and not overwrite:
            raise CheckpointError(f"{dst} appeared while converting; not overwriting it.")


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def verify_conversion(ctx: _Ctx, dst: Path, to: str, dtype: torch.dtype | None) -> int:
    """Read every HF tensor of ``dst`` and compare bit-exactly with the source (cast to dtype)."""
    fmt = {"hf": "hf", "mcore": mcore_dist.FORMAT, "megatron-legacy": megatron_legacy.FORMAT}[to]
    a = _open(ctx)
    b = open_checkpoint(dst, ctx.hf_config if to != "hf" else None, fmt)
    try:
        bad, n = [], 0
        for name, shape in a.adapter.expected_tensors().items():
            x = a.read(name, _full(shape))
            if dtype is not None and x.is_floating_point():
                x = x.to(dtype)
            y = b.read(name, _full(shape))
            n += 1
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                bad.append(name)
        if bad:
            raise CheckpointError(f"verification failed: {len(bad)} tensor(s) of {dst} differ "
                                  f"from the source: {', '.join(bad[:8])}.")
        return n
    finally:
        a.source.close()
        b.source.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Progress:
    """A rich progress bar with bytes, speed and ETA (silent when ``enabled`` is False)."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled, total, label
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total)
        return self

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, nbytes)

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


# -- inspect --------------------------------------------------------------------------------------

@dataclass
class Info:
    path: Path
    format: str | None
    architecture: str | None = None
    layout: dict[str, Any] = field(default_factory=dict)
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> number of tensors
    parameters: int = 0
    tensors: int = 0
    files: list[str] = field(default_factory=list)
    iteration: int | None = None
    problems: list[str] = field(default_factory=list)


def inspect(path: str | Path, *, hf_config: str | Path | None = None,
            source_format: str | None = None) -> Info:
    """What a checkpoint folder holds, and the consistency problems found (never raises for a
    damaged checkpoint: the problems are listed)."""
    path = Path(path)
    try:
        fmt = source_format or detect(path)
    except CheckpointError as err:
        return Info(path, None, problems=[str(err)])
    info = Info(path, fmt)
    try:
        op = open_checkpoint(path, hf_config, fmt)
    except (CheckpointError, ValueError, OSError) as err:
        info.problems.append(f"{type(err).__name__}: {err}")
        info.files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
        return info
    try:
        info.architecture = op.adapter.architecture
        info.iteration = op.info.get("iteration")
        info.layout = {k: v for k, v in (op.info.get("layout") or {}).items() if v}
        info.files = [str(f) for f in op.info.get("files", [])]
        for name, shape in op.adapter.expected_tensors().items():
            dt = str(op.source.dtype(op.names[name])).replace("torch.", "")
            info.dtypes[dt] = info.dtypes.get(dt, 0) + 1
            info.parameters += _numel(shape)
            info.tensors += 1
    finally:
        op.source.close()
    return info
