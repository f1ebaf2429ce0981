"""Checkpoint saves: the training stall per save, synchronous vs asynchronous, and mdtk's save
time vs DeepSpeed's own ``save_checkpoint`` of the same engine.

One process (a gloo group of 1), a Llama-3.2-1B-shaped model (hidden 2048, 32 heads, 8 KV
heads, FFN 8192, vocab 128256, tied embeddings) from transformers with random weights,
``--layers`` decoder layers (16 in the real model; fewer where host memory cannot hold the
engine plus its host copy: the tensor shapes, so the copy and write speeds, stay those of the
1B model), DeepSpeed ZeRO-1 in ``--precision`` (bf16: 2 B/param weights + 12 B/param fp32 master
and Adam states in the checkpoint). Each round, alternating:

- ``deepspeed``: ``engine.save_checkpoint`` (torch.save of each file, no fsync, no manifest):
  the baseline;
- ``sync``: ``Saver.save`` with ``checkpoint.async: false`` (the same files written by mdtk,
  fsynced, hashed into the manifest, published atomically): the step loop is blocked for all
  of it;
- ``async``: ``Saver.save`` with ``checkpoint.async: true``, then training steps with
  ``Saver.poll`` at each boundary until the checkpoint is published: the stall is the time the
  loop spent inside ``save`` and ``poll`` (``SaveTiming.blocked_s``); also the step time while the
  writer thread runs vs without. It saves the state the synchronous save just saved, so the
  two manifests (every file's size and xxh3-128) must be equal (``async_files_identical_to_sync``;
  on a GPU this checks the host copies of CUDA tensors too). A last round saves both ways with
  no step while the asynchronous save writes (``..._without_steps``): a difference only with
  steps means a snapshot the steps still reach. Each differing file is explained
  (``explain_difference``: the zip entries that differ, the first differing pickle opcode, the
  state-dict paths whose values differ).

DeepSpeed's files are also fsynced and hashed after its save, timed apart
(``deepspeed_fsync_hash_s``): mdtk's synchronous save does both (durable, checksummed), DeepSpeed's
returns with the bytes in the page cache, so ``sync / (deepspeed + fsync_hash)`` compares like
with like. Prints medians and spreads (min-max) of the rounds after a warm-up (one asynchronous
save), and the ratios ``async stall / sync save`` and ``sync save / deepspeed save``.

    python scripts/bench_checkpoint.py [--layers 2] [--rounds 3] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                rope_theta=500000.0)


def build_engine(layers: int, precision: str, device: str):
    import deepspeed
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(**LLAMA_1B, num_hidden_layers=layers, max_position_embeddings=2048)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ds = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
          "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
          "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds)
    return engine, sum(p.numel() for p in model.parameters())


def train_step(engine, seq: int) -> float:
    import torch

    start = time.perf_counter()
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (1, seq), device=engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start


def _state(step: int):
    from toolkit.parallel import ParallelLayout
    from toolkit.train.checkpoints.state import TrainingState

    return TrainingState(step=step, consumed_samples=step, world_size=1, dp_size=1,
                         global_batch=1, micro_batch=1, seed=0,
                         layout=dataclasses.asdict(ParallelLayout().resolve(1)))


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _durable(folder: Path) -> float:
    """Seconds to fsync and xxh3-hash every file of ``folder`` after it was written: what mdtk's
    synchronous save does on top of DeepSpeed's (which returns with the bytes in the page
    cache, not on disk, and records no checksums)."""
    from toolkit.checkpoint.manifest import hash_file

    start = time.perf_counter()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        hash_file(path)
    return time.perf_counter() - start


def _walk(a, b, path: str, out: list[str]) -> None:
    """The paths where two loaded state dicts differ (tensors: dtype, shape, values)."""
    import torch

    if len(out) >= 20:
        return
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
            out.append(f"{path}: {a.dtype} {tuple(a.shape)} {a.device} vs "
                       f"{b.dtype} {tuple(b.shape)} {b.device}")
        elif not torch.equal(a, b):
            bad = (a != b).sum().item()
            diff = (a.float() - b.float()).abs().max().item()
            out.append(f"{path}: {bad} of {a.numel()} values differ (max abs {diff:.3g})")
    elif isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            out.append(f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))[:8]} or order")
        for k in (k for k in a if k in b):
            _walk(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(x, y, f"{path}[{i}]", out)
    elif type(a) is not type(b) or a != b:
        out.append(f"{path}: {str(a)[:80]!r} vs {str(b)[:80]!r}")


def _pickle_diff(a: bytes, b: bytes) -> str:
    """The first pickle opcode where two ``data.pkl`` differ, with the ones before it."""
    import pickletools

    ops_a, ops_b = (list(pickletools.genops(x)) for x in (a, b))
    for i, (x, y) in enumerate(zip(ops_a, ops_b, strict=False)):
        if (x[0].name, x[1]) != (y[0].name, y[1]):
            before = [f"{o[0].name} {o[1]!r}"[:60] for o in ops_a[max(0, i - 6):i]]
            return (f"op {i} of {len(ops_a)}/{len(ops_b)}: {x[0].name} {x[1]!r} vs "
                    f"{y[0].name} {y[1]!r}; before: {before}")
    return f"same ops up to {min(len(ops_a), len(ops_b))} (lengths {len(ops_a)}/{len(ops_b)})"


def explain_difference(a: Path, b: Path) -> dict:
    """Why two ``torch.save`` files differ: the zip entries whose bytes differ (a pickle's
    first differing opcode; a storage's count and span of differing bytes), and the paths of
    the loaded state dicts whose values differ (read with mdtk's safe loader)."""
    import zipfile

    import numpy as np

    from toolkit.checkpoint.torchfree.safe_load import load_torch

    out: dict = {"entries": {}}
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        names_a = [n.split("/", 1)[1] for n in za.namelist()]
        names_b = [n.split("/", 1)[1] for n in zb.namelist()]
        if names_a != names_b:
            out["entry_names"] = [sorted(set(names_a) - set(names_b))[:8],
                                  sorted(set(names_b) - set(names_a))[:8]]
        for full_a, full_b in zip(za.namelist(), zb.namelist(), strict=False):
            x, y = za.read(full_a), zb.read(full_b)
            if x == y:
                continue
            name = full_a.split("/", 1)[1]
            if name.endswith(".pkl"):
                out["entries"][name] = _pickle_diff(x, y)
            elif len(x) != len(y):
                out["entries"][name] = f"{len(x)} vs {len(y)} bytes"
            else:
                d = np.flatnonzero(np.frombuffer(x, np.uint8) != np.frombuffer(y, np.uint8))
                out["entries"][name] = (f"{d.size} of {len(x)} bytes differ, offsets "
                                        f"{d[0]}..{d[-1]}")
    paths: list[str] = []
    _walk(load_torch(a, mmap=False), load_torch(b, mmap=False), "", paths)
    out["values"] = paths
    return out


def _differing(sync_manifest: str, async_manifest: str) -> list[str]:
    """The files whose size or xxh3-128 differ between the two saves (or exist in one only):
    named, so that a mismatch seen on a rare GPU run says where to look."""
    a, b = (json.loads(m)["files"] for m in (sync_manifest, async_manifest))
    return sorted(f for f in a.keys() | b.keys() if a.get(f) != b.get(f))


def _sync_saves(engine, sync, work: Path, r: int) -> dict:
    """DeepSpeed's ``save_checkpoint`` (then its files made durable and hashed, timed apart),
    and mdtk's synchronous save of the same state: seconds, bytes, mdtk's manifest."""
    folder = work / f"ds_{r}"
    start = time.perf_counter()
    engine.save_checkpoint(str(folder), tag="engine", save_latest=False)
    out = {"deepspeed_s": time.perf_counter() - start, "deepspeed_fsync_hash_s": _durable(folder),
           "bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())}
    shutil.rmtree(folder)
    start = time.perf_counter()
    out["manifest"] = (sync.save(engine, _state(r + 1)) / "manifest.json").read_text()
    out["sync_s"] = time.perf_counter() - start
    return out  # work/sync stays until the asynchronous save of this state is compared


def _compare(work: Path, sync_manifest: str, step: int) -> tuple[list[str], dict]:
    """The files of the asynchronous save of ``step`` that differ from the synchronous save's,
    and why (``explain_difference`` of each); both saves are removed afterwards."""
    folder = f"step_{step:07d}"
    async_manifest = (work / "async" / folder / "manifest.json").read_text()
    differing = _differing(sync_manifest, async_manifest)
    why = {}
    for name in differing:
        a, b = work / "sync" / folder / name, work / "async" / folder / name
        if a.is_file() and b.is_file() and name.endswith(".pt"):
            try:
                why[name] = explain_difference(a, b)
            except Exception as e:  # noqa: BLE001 - the diagnosis must not lose the figures
                why[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    shutil.rmtree(work / "sync")
    shutil.rmtree(work / "async")
    return differing, why


def measure(args: argparse.Namespace, work: Path) -> dict:
    from toolkit.train.checkpoints.folders import CheckpointManager
    from toolkit.train.checkpoints.saver import Saver

    engine, params = build_engine(args.layers, args.precision, args.device)
    quiet = lambda text: None  # noqa: E731
    sync = Saver(CheckpointManager(work / "sync"), log=quiet)
    later = Saver(CheckpointManager(work / "async"), asynchronous=True, log=quiet)
    later.prepare(engine)
    later.writer.wait()  # the staging buffers reserved (as they are before a run's first save)
    idle = [train_step(engine, args.seq) for _ in range(2)][1:]
    runs: dict[str, list[float]] = {k: [] for k in (
        "deepspeed_s", "deepspeed_fsync_hash_s", "sync_s", "async_stall_s", "async_total_s",
        "step_idle_s", "step_writing_s")}
    differing: list[list[str]] = []  # per round: files whose bytes differ
    explained: dict[str, dict] = {}  # a differing file -> why (explain_difference)
    for r in range(args.rounds + 1):
        # round 0 warms up the asynchronous path only (its first stall is ~10x the later ones:
        # first copies into the pinned staging buffers); DeepSpeed's and mdtk's synchronous
        # saves take the same time in their first round and later ones (H100 run, 2026-11-26)
        warm = r == 0
        if not warm:
            idle.append(train_step(engine, args.seq))
            saved = _sync_saves(engine, sync, work, r)
        later.save(engine, _state(r + 1))  # the sync round's state: the same files expected
        writing = []
        while later.flight is not None:
            writing.append(train_step(engine, args.seq))
            later.poll()
        timing = later.timings[-1]
        during = statistics.median(writing)
        if warm:
            print(f"round 0 (warm-up, async only): stall {timing.blocked_s:.3f} s, written in "
                  f"{timing.total_s:.2f} s during {len(writing)} steps", flush=True)
            shutil.rmtree(work / "async")
            continue
        files, why = _compare(work, saved["manifest"], r + 1)
        differing.append(files)
        explained.update(why)
        print(f"round {r}: deepspeed {saved['deepspeed_s']:.2f} s (+ fsync and hash of its "
              f"files {saved['deepspeed_fsync_hash_s']:.2f} s), mdtk sync {saved['sync_s']:.2f} "
              f"s, async stall {timing.blocked_s:.3f} s (written in {timing.total_s:.2f} s "
              f"during {len(writing)} steps of {during:.2f} s; idle step {idle[-1]:.2f} s)",
              flush=True)
        for key, value in (("deepspeed_s", saved["deepspeed_s"]),
                           ("deepspeed_fsync_hash_s", saved["deepspeed_fsync_hash_s"]),
                           ("sync_s", saved["sync_s"]), ("async_stall_s", timing.blocked_s),
                           ("async_total_s", timing.total_s), ("step_idle_s", idle[-1]),
                           ("step_writing_s", during)):
            runs[key].append(value)
    # the same comparison with no step running while the asynchronous save writes: tells a
    # snapshot that later steps still reach from a difference in how the files are written
    quiet_state = _state(args.rounds + 2)
    quiet_manifest = (sync.save(engine, quiet_state) / "manifest.json").read_text()
    later.save(engine, quiet_state)
    later.finish()
    quiet, quiet_why = _compare(work, quiet_manifest, quiet_state.step)
    stats = {k: _spread(v) for k, v in runs.items()}
    med = {k: v["median"] for k, v in stats.items()}
    return {"params": params, "layers": args.layers, "precision": args.precision,
            "checkpoint_bytes": saved["bytes"], "staging_bytes": later.pool.bytes,
            "rounds": args.rounds,
            "async_files_identical_to_sync": not any(differing),
            "async_files_differing": sorted({f for d in differing for f in d}),
            "async_files_differing_why": explained,
            "async_files_identical_to_sync_without_steps": not quiet,
            "async_files_differing_without_steps": {f: quiet_why.get(f) for f in quiet},
            "stats": stats, "stall_over_sync": med["async_stall_s"] / med["sync_s"],
            "stall_over_sync_per_round": [a / s for a, s in zip(runs["async_stall_s"],
                                                                 runs["sync_s"], strict=True)],
            "sync_over_deepspeed": med["sync_s"] / med["deepspeed_s"],
            "sync_over_deepspeed_made_durable": med["sync_s"] / (
                med["deepspeed_s"] + med["deepspeed_fsync_hash_s"]),
            "step_slowdown_while_writing": med["step_writing_s"] / med["step_idle_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2, help="decoder layers (Llama-3.2-1B: 16)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds after one warm-up")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--seq", type=int, default=32, help="tokens of each training step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dir", type=Path, help="where to write the checkpoints (default: a temp "
                   "folder under /tmp); removed afterwards")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    from toolkit.runtime.ports import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from toolkit import runtime

    runtime.prepare_deepspeed()
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir))
    try:
        out = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = out["stats"]
    print(f"{out['params'] / 1e6:.0f}M params ({args.layers} layers), {args.precision}, "
          f"checkpoint {out['checkpoint_bytes'] / 2**30:.2f} GiB, staging "
          f"{out['staging_bytes'] / 2**30:.2f} GiB; medians (min-max) of {args.rounds} rounds:")
    for key, v in s.items():
        print(f"  {key:22s} {v['median']:8.3f} ({v['min']:.3f}-{v['max']:.3f})")
    print(f"async stall / sync save: {out['stall_over_sync']:.3f} (per round "
          f"{', '.join(f'{x:.3f}' for x in out['stall_over_sync_per_round'])}); sync save / "
          f"deepspeed save_checkpoint: {out['sync_over_deepspeed']:.2f} (made durable and hashed: "
          f"{out['sync_over_deepspeed_made_durable']:.2f}); steps while writing: "
          f"{out['step_slowdown_while_writing']:.2f}x; async files identical to sync: "
          f"{out['async_files_identical_to_sync']} (with no step during the write: "
          f"{out['async_files_identical_to_sync_without_steps']})")
    for name, why in {**out["async_files_differing_why"],
                      **out["async_files_differing_without_steps"]}.items():
        print(f"  {name} differs: {json.dumps(why)[:2000]}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
