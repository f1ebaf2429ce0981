"""Rank functions for the checkpoint saves (tests/test_checkpoint_saves.py): asynchronous saves,
manifests, a full disk, self-contained checkpoints, through real DeepSpeed engines and the real
trainer on 2 gloo ranks."""

from __future__ import annotations

import contextlib
import io
import resource
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import torch

from dist_checks import trainer_checks as tc


def all_checks(workdir: str, small: str, fsize_limit: int | None,
               assets: dict[str, str]) -> dict[str, Any]:
    """Every check of this file in one pool job (tests/test_checkpoint_saves.py)."""
    root = Path(workdir)
    return {"engine": async_matches_sync(str(root / "engine")),
            "disk": full_disk(small, fsize_limit),
            "trainer": trainer_saves(assets, str(root)),
            "pretrain": pretrain_tiny(assets["tokenizer"], str(root))}


# -- a real ZeRO-2 engine through the saver ------------------------------------------------------
def zero2_engine(seed: int, width: int = 32, stage: int = 2, bf16: bool = False):
    """A real DeepSpeed ZeRO engine (every rank, micro-batch 2; ZeRO-2 unless ``stage``, fp32
    unless ``bf16``) of a small MLP, on the accelerator's device."""
    import deepspeed
    import torch.distributed as dist

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Tanh(),
                                torch.nn.Linear(2 * width, 1))
    config = {"train_batch_size": 2 * dist.get_world_size(), "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
              "bf16": {"enabled": bf16}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return engine


def train_step(engine, k: int, rank: int, width: int = 32) -> float:
    """Step ``k`` of ``zero2_engine``: batch ``k`` (the rank's rows) plus RNG-drawn noise."""
    import torch.distributed as dist

    rows = 2 * dist.get_world_size()
    g = torch.Generator().manual_seed(100 + k)
    x, y = torch.randn(rows, width, generator=g), torch.randn(rows, 1, generator=g)
    sl = slice(2 * rank, 2 * rank + 2)
    noise = torch.randn(2, 1) * 1e-3  # consumes the global torch RNG, like dropout would
    dtype = next(engine.module.parameters()).dtype
    x, y, noise = (t.to(engine.device, dtype) for t in (x[sl], y[sl], noise))
    loss = ((engine(x) + noise - y) ** 2).float().mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _state(step: int):
    import dataclasses

    import torch.distributed as dist

    from toolkit.parallel import ParallelLayout
    from toolkit.train.checkpoints.state import TrainingState

    world = dist.get_world_size() if dist.is_initialized() else 2
    layout = ParallelLayout().resolve(world)
    return TrainingState(step=step, consumed_samples=2 * world * step, world_size=world,
                         dp_size=world, global_batch=2 * world, micro_batch=2, seed=1,
                         layout=dataclasses.asdict(layout), config={})


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _gated(saver) -> threading.Event:
    """Hold the saver's writer thread until the event is set (its job starts after it)."""
    gate = threading.Event()
    submit = saver.writer.submit
    saver.writer.submit = lambda fn: submit(lambda: (gate.wait(60), fn()))
    return gate


def async_matches_sync(root: str, width: int = 32, stage: int = 2,
                       bf16: bool = False) -> dict[str, Any]:
    """Step 3 saved synchronously and asynchronously (its files written only after 3 more
    steps changed the live state): the same bytes; a resume from the asynchronous one continues
    like the run that never stopped; the staging pool against the memory model. Files that
    differ are explained (``scripts/bench_checkpoint.explain_difference``)."""
    import torch.distributed as dist

    from toolkit import runtime
    from toolkit.train.checkpoints.folders import CheckpointManager
    from toolkit.train.checkpoints.saver import Saver

    runtime.prepare_deepspeed()
    rank = dist.get_rank()
    engine = zero2_engine(seed=0, width=width, stage=stage, bf16=bf16)
    sync = Saver(CheckpointManager(Path(root) / "sync"))
    later = Saver(CheckpointManager(Path(root) / "async"), asynchronous=True)
    later.prepare(engine)
    for k in range(3):
        train_step(engine, k, rank, width)
    sync_path = sync.save(engine, _state(3))
    gate = _gated(later)
    returned = later.save(engine, _state(3))  # None: in flight
    during = sorted(p.name for p in (Path(root) / "async").iterdir())
    uninterrupted = [train_step(engine, k, rank, width) for k in (3, 4, 5)]
    pending_polls = [later.poll() for _ in range(2)]  # the writer is held: not published
    gate.set()
    async_path = later.finish()
    staging = later.pool.bytes
    params = sum(p.numel() for p in engine.module.parameters())
    engine.destroy()

    resumed_engine = zero2_engine(seed=5, width=width, stage=stage, bf16=bf16)
    loaded, _ = resumed_engine.load_checkpoint(str(async_path), tag="engine")
    from toolkit.train.checkpoints.state import load_rng

    load_rng(async_path, rank)
    resumed = [train_step(resumed_engine, k, rank, width) for k in (3, 4, 5)]
    resumed_engine.destroy()
    dist.barrier()
    files = {"sync": _files(sync_path), "async": _files(async_path)}
    why = {}
    for name in sorted(n for n in files["sync"] if files["async"].get(n) != files["sync"][n]):
        if name.endswith(".pt") and name in files["async"]:
            from dist_checks import load_script

            explain = load_script("bench_checkpoint").explain_difference
            why[name] = explain(sync_path / name, async_path / name)
    return {"returned": returned, "during": during, "pending_polls": pending_polls,
            **files, "why": why, "loaded": loaded is not None,
            "uninterrupted": uninterrupted, "resumed": resumed, "staging_bytes": staging,
            "params": params,
            "timings": [t.__dict__ for t in later.timings]}


@contextlib.contextmanager
def _file_size_limit(limit: int | None):
    """RLIMIT_FSIZE (writes past ``limit`` bytes fail with EFBIG; SIGXFSZ ignored): the full
    disk where the test cannot mount a small tmpfs."""
    if limit is None:
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, previous)


def full_disk(root: str, fsize_limit: int | None) -> dict[str, Any]:
    """Saves into a file system that fills up (a small tmpfs at ``root``, or ``fsize_limit``):
    step 1 fits; the synchronous save of step 2 and the asynchronous one of step 3 fail (the
    error text, the folders left); with on_save_error=continue the run goes on."""
    import torch.distributed as dist

    from toolkit import runtime
    from toolkit.train.checkpoints.folders import CheckpointManager
    from toolkit.train.checkpoints.saver import SaveError, Saver

    runtime.prepare_deepspeed()
    rank = dist.get_rank()
    engine = zero2_engine(seed=0)
    manager = CheckpointManager(Path(root) / "ck")
    out: dict[str, Any] = {}
    train_step(engine, 0, rank)
    first = Saver(manager).save(engine, _state(1))
    out["first"] = str(first)
    logged: list[str] = []
    for name, saver, step in (
            ("sync", Saver(manager), 2),
            ("async", Saver(manager, asynchronous=True), 3),
            ("continue", Saver(manager, asynchronous=True, on_error="continue",
                               log=logged.append), 4)):
        train_step(engine, step, rank)
        with _file_size_limit(fsize_limit), _padding(root, fsize_limit):
            try:
                saver.save(engine, _state(step))
                saver.finish()
                out[name] = None
            except SaveError as e:
                out[name] = str(e)
        dist.barrier()
        out[f"{name}_listing"] = sorted(p.name for p in manager.root.iterdir())
        out[f"{name}_latest"] = (manager.root / "latest").read_text().strip()
    out["continue_log"] = logged
    out["after"] = train_step(engine, 5, rank)  # trains on
    out["first_intact"] = [str(p) for p in manager.verify(first)]
    engine.destroy()
    return out


@contextlib.contextmanager
def _padding(root: str, fsize_limit: int | None):
    """On the small tmpfs: a file taking all but 48 KiB of the free space while a save runs:
    room for DeepSpeed's recovery scripts (44 KiB, copied by rank 0 inside ``save_checkpoint``),
    not for the engine files after them (so an asynchronous save fails in its writer thread)."""
    import torch.distributed as dist

    pad = Path(root) / "padding"
    if fsize_limit is None and dist.get_rank() == 0:
        free = shutil.disk_usage(root).free
        with open(pad, "wb") as f:
            f.write(b"\0" * max(free - (48 << 10), 0))
    dist.barrier()
    try:
        yield
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            pad.unlink(missing_ok=True)


# -- the trainer -------------------------------------------------------------------------------
def _run(case: tc.Case, assets: dict[str, str], out: Path) -> dict[str, Any]:
    """The trainer's run of ``case`` in ``out``; its losses, start, and rank 0's log."""
    from toolkit.errors import UserError
    from toolkit.train import trainer

    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            result = trainer.run(tc.config(case, assets, out))
    except UserError as e:
        return {"error": str(e), "log": text.getvalue()}
    return {"losses": result.losses, "start": result.start_step, "log": text.getvalue()}


def trainer_saves(assets: dict[str, str], workdir: str) -> dict[str, Any]:
    """The real trainer, 2 ranks (dp2, ZeRO-1): a synchronous and an asynchronous run of 4 steps
    (checkpoints at 2 and 4); then a byte of the asynchronous run's newest checkpoint flipped:
    ``resume: auto`` goes on from step 2 (bit-exactly), the damaged folder named explicitly is
    refused."""
    root = Path(workdir)
    every = ("checkpoint.interval=2", "checkpoint.keep_last=0", "checkpoint.resume=auto")
    sync = _run(tc.Case("saves_sync", steps=4, overrides=every), assets, root / "sync")
    run = tc.Case("saves_async", steps=4, overrides=(*every, "checkpoint.async=true"))
    asyn = _run(run, assets, root / "async")
    out: dict[str, Any] = {"sync": sync, "async": asyn}
    ckpts = {name: root / name / "checkpoints" for name in ("sync", "async")}
    out["files"] = {name: {step: _files(c / f"step_000000{step}") for step in (2, 4)}
                    for name, c in ckpts.items()}
    import torch.distributed as dist

    damaged = ckpts["async"] / "step_0000004"
    if dist.get_rank() == 0:
        files = [p for p in damaged.rglob("*") if p.is_file()]
        largest = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(largest.read_bytes())
        data[len(data) // 2] ^= 0x01
        largest.write_bytes(bytes(data))
        out["flipped"] = largest.relative_to(damaged).as_posix()
        shutil.copytree(damaged, root / "damaged" / damaged.name)  # the resume below replaces it
    dist.barrier()
    longer = tc.Case("saves_async", steps=6, overrides=(*every, "checkpoint.async=true"))
    out["auto"] = _run(longer, assets, root / "async")
    copy = root / "damaged" / damaged.name
    out["damaged_copy"] = str(copy)
    named = tc.Case("saves_named", steps=6, overrides=(f"checkpoint.resume={copy}",))
    out["named"] = _run(named, assets, root / "named")
    return out


def pretrain_tiny(tokenizer: str, workdir: str) -> dict[str, Any]:
    """``examples/pretrain_tiny.yaml`` (tp2, a model from config.json alone) for 2 steps."""
    from toolkit.train import trainer
    from toolkit.train.config import load_config

    out = Path(workdir) / "pretrain_tiny"
    cfg = load_config("bundled:examples/pretrain_tiny.yaml", [
        f"output_dir={out}", f"model.tokenizer={tokenizer}", "train.steps=2",
        "optim.warmup_steps=1",
        "train.eval_interval=0", "data.validation_split=0", "checkpoint.interval=2",
        f"data.cache_dir={out / 'cache'}", "train.seq_len=32"])
    result = trainer.run(cfg)
    return {"losses": result.losses, "checkpoint": str(out / "checkpoints" / "step_0000002")}
