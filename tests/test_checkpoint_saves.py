"""Checkpoints at scale (issue 28): manifests with checksums verified on resume and by
``mdtk inspect``, asynchronous saves byte-identical to synchronous ones, a full disk survived,
self-contained trainer checkpoints, ``keep_every``.

The unit tests need no process; the distributed ones run in one ``rank_pool_2`` job
(``checkpoint_save_checks.all_checks``): a real ZeRO-2 engine through the saver, a save into a
small tmpfs made here (or, where mounting is refused, RLIMIT_FSIZE in the ranks), and the real
trainer (dp2 ZeRO-1 sync vs async, a flipped byte, ``examples/pretrain_tiny.yaml``)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from toolkit.checkpoint import manifest
from toolkit.parallel import ParallelLayout
from toolkit.train.checkpoints.folders import CheckpointManager
from toolkit.train.checkpoints.snapshot import StagingPool, snapshot
from toolkit.train.checkpoints.state import ResumeError, TrainingState


def _state(step: int) -> TrainingState:
    layout = ParallelLayout().resolve(1)
    return TrainingState(step=step, consumed_samples=step, world_size=1, dp_size=1,
                         global_batch=1, micro_batch=1, seed=1,
                         layout=dataclasses.asdict(layout))


def _engine_files(folder: Path) -> None:
    (folder / "engine").mkdir()
    (folder / "engine" / "weights.pt").write_bytes(bytes(range(256)) * 40)


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


# -- unit: manifest, retention, resume lookup --------------------------------------------------
def test_manifest_names_each_damaged_file(tmp_path):
    (tmp_path / "a").mkdir()
    files = {"a/x.bin": b"x" * 5000, "y.bin": b"y" * 10, "z.bin": b"z" * 3000}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    records = [manifest.record(tmp_path, tmp_path / n) for n in files]
    manifest.write(tmp_path, records)
    assert manifest.read(tmp_path) == sorted(records)
    assert manifest.verify(tmp_path) == []
    _flip(tmp_path / "a/x.bin")
    (tmp_path / "y.bin").unlink()
    (tmp_path / "z.bin").write_bytes(b"z" * 2999)
    problems = {p.path: p.what for p in manifest.verify(tmp_path)}
    assert set(problems) == set(files)
    assert "differs from the manifest" in problems["a/x.bin"]
    assert problems["y.bin"] == "missing"
    assert problems["z.bin"].startswith("2999 bytes, the manifest says 3000")
    # sizes only: the flipped byte goes unnoticed, the truncation does not
    assert {p.path for p in manifest.verify(tmp_path, checksums=False)} == {"y.bin", "z.bin"}
    # the ranks' shares cover every file once, the largest files spread first
    shares = [manifest.share(records, r, 2) for r in (0, 1)]
    assert sorted(r.path for s in shares for r in s) == sorted(files)
    assert [r.path for r in shares[0]] == ["a/x.bin"]
    (tmp_path / manifest.MANIFEST).write_text("{not json")
    assert "the manifest itself is damaged" in manifest.verify(tmp_path)[0].what


def test_keep_every_and_resume_skips_a_damaged_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_every=3)
    for step in range(1, 8):
        mgr.save(_state(step), _engine_files)
    assert [s for s, _ in mgr.complete()] == [3, 6, 7]  # 3 and 6 kept by keep_every
    newest = tmp_path / "step_0000007"
    listed = {r.path for r in manifest.read(newest)}
    assert listed == {"engine/weights.pt", "latest", "rng/rank_00000.pt", "trainer_state.json"}
    _flip(newest / "engine" / "weights.pt")
    warnings: list[str] = []
    assert mgr.resolve_resume("auto", warn=warnings.append) == tmp_path / "step_0000006"
    assert len(warnings) == 1 and "step_0000007 is damaged (engine/weights.pt: xxh3_128" in (
        warnings[0])
    with pytest.raises(ResumeError, match=r"step_0000007' is damaged: engine/weights.pt: "
                                          r"xxh3_128 .* differs.*step_0000006"):
        mgr.resolve_resume(str(newest))
    # sizes only: the flip is not seen; a truncation is
    assert mgr.resolve_resume(str(newest), checksums=False) == newest
    for _, path in mgr.complete():
        (path / "engine" / "weights.pt").write_bytes(b"")
    with pytest.raises(ResumeError, match="every checkpoint under .* is damaged"):
        mgr.resolve_resume("auto", checksums=False, warn=warnings.append)
    with pytest.raises(ResumeError, match="keep_every=-1 must be >= 0"):
        CheckpointManager(tmp_path, keep_every=-1)


def test_config_keys_and_memory_line():
    from toolkit.memory.activations import TrainShape
    from toolkit.memory.estimate import estimate
    from toolkit.memory.states import RankParams, ZeroOptions, checkpoint_staging_item
    from toolkit.train.config import apply_overrides, typed
    from toolkit.train.config.schema import TrainConfig

    raw = apply_overrides({}, ["checkpoint.async=true", "checkpoint.keep_every=5",
                               "checkpoint.verify=sizes", "checkpoint.on_save_error=continue"])
    cfg = typed.build(TrainConfig, raw, "")  # the schema alone (a run needs more keys)
    c = cfg.checkpoint
    assert (c.async_, c.keep_every, c.verify, c.on_save_error) == (True, 5, "sizes", "continue")
    assert cfg.to_dict()["checkpoint"]["async"] is True  # the YAML key, not the field name
    assert typed.build(TrainConfig, cfg.to_dict(), "").checkpoint.async_ is True
    # dp rank 0 of ZeRO-1 bf16 at dp=4: 2 B/param of module state + its quarter of the fp32
    # master weights and Adam m, v (12 B/param)
    params = RankParams(dense=4_000_000, expert=0, dense_dp=4, expert_dp=1, persistent=0,
                        largest_layer=0, largest_tensor=0)
    item = checkpoint_staging_item(params, ZeroOptions(stage=1), "bf16")
    assert (item.device, item.bytes) == ("cpu", 2 * 4_000_000 + 12 * 1_000_000)
    stage3 = checkpoint_staging_item(params, ZeroOptions(stage=3), "bf16")
    assert stage3.bytes == 14 * 1_000_000
    # the estimate of a run with checkpoint.async counts that host line, and nothing else moves
    from toolkit.memory.model import ModelShape

    model = ModelShape(hidden=256, layers=2, heads=4, kv_heads=4, head_dim=64, ffn=1024,
                       vocab=1000)
    train = dict(seq_len=128, micro_batch=1, dtype="bf16")
    plain = estimate(model, TrainShape(**train), ParallelLayout().resolve(4), ZeroOptions(stage=1))
    saving = estimate(model, TrainShape(async_checkpoint=True, **train),
                      ParallelLayout().resolve(4), ZeroOptions(stage=1))
    extra = [i for i in saving.items if i not in plain.items]
    assert [i.what for i in extra] == [checkpoint_staging_item(
        saving.params, ZeroOptions(stage=1), "bf16").what]
    assert saving.total("cpu") - plain.total("cpu") == extra[0].bytes == (
        2 * saving.params.dense + 12 * -(-saving.params.dense // 4))


# -- unit: the snapshot writes what the live state would have written ----------------------------
def test_snapshot_is_byte_identical_and_detached(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    module.register_buffer("steps", torch.tensor(3))
    flat = torch.randn(64)
    views = [flat[:32].view(4, 8), flat[32:36], flat[36:40]]  # one storage, like a ZeRO buffer
    state = {"module": module.state_dict(), "flat": flat, "views": views,
             "param": torch.nn.Parameter(torch.ones(3)), "grad_on": torch.zeros(2).requires_grad_(),
             "meta": collections.OrderedDict(lr=1e-3, name="cpu", betas=(0.9, 0.95)),
             "same_name": ["cpu", "cpu"]}
    assert hasattr(state["module"], "_metadata")
    (tmp_path / "live").mkdir()
    (tmp_path / "copy").mkdir()
    torch.save(state, tmp_path / "live" / "f.pt")
    pool = StagingPool()
    copy = snapshot(state, pool)
    assert pool.bytes == flat.nbytes + sum(
        t.untyped_storage().nbytes() for t in module.state_dict().values()) + 12 + 8
    with torch.no_grad():  # the next optimizer step changes the live state in place
        flat.add_(1.0)
        module[0].weight.mul_(2.0)
        state["param"].add_(1.0)
    torch.save(copy, tmp_path / "copy" / "f.pt")
    assert (tmp_path / "copy" / "f.pt").read_bytes() == (tmp_path / "live" / "f.pt").read_bytes()
    assert copy["views"][1].untyped_storage().data_ptr() == copy["flat"].data_ptr()
    pool.release()
    again = snapshot(state, pool)  # the next save reuses the same buffers
    assert pool.bytes == flat.nbytes + sum(
        t.untyped_storage().nbytes() for t in module.state_dict().values()) + 12 + 8
    assert torch.equal(again["flat"], flat)


def test_copies_of_gpu_storages_are_tagged_as_torch_tags_gpu_storages(tmp_path):
    """A host copy of a CUDA storage is recorded with its source's location, and the way torch
    records it: a new location string per storage record, so that every view of a storage
    (ZeRO's flat buffer) pickles as it does from the GPU. A single string reused for every
    view was memoised by pickle (BINGET) and the model states differed from a synchronous
    save's on the H200 (2026-11-28); CPU storages ("cpu", one constant) never showed it."""
    import io
    import pickletools
    import zipfile

    from toolkit.train.checkpoints import snapshot as snap

    flat = torch.arange(8, dtype=torch.float32)
    state = {"a": flat[:4], "b": flat[4:], "c": torch.ones(2)}
    snap._register_tagger()
    snap._ORIGIN[flat.data_ptr()] = torch.device("cuda", 0)  # as snapshot() registers a copy
    try:
        tags = [torch.serialization.location_tag(flat.untyped_storage()) for _ in range(2)]
        buf = io.BytesIO()
        torch.save(state, buf)
    finally:
        snap._ORIGIN.pop(flat.data_ptr())
    assert tags == ["cuda:0", "cuda:0"] and tags[0] is not tags[1]  # torch's _backend_tag
    assert torch.serialization.location_tag(flat.untyped_storage()) == "cpu"  # untagged again
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    strings = [arg for op, arg, _ in pickletools.genops(pkl) if op.name == "BINUNICODE"]
    assert strings.count("cuda:0") == 2 and strings.count("cpu") == 1  # one per view of flat


# -- distributed: engine saves, a full disk, the trainer ---------------------------------------
@contextlib.contextmanager
def _small_tmpfs(path: Path):
    """A 4 MiB tmpfs at ``path``; yields False where mounting is refused (no root)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)],
                          capture_output=True)
    try:
        yield done.returncode == 0
    finally:
        if done.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def saves(rank_pool_2, trainer_assets, tmp_path_factory):
    from dist_checks import checkpoint_save_checks as cs

    assets, root = trainer_assets
    work = tmp_path_factory.mktemp("saves")
    with _small_tmpfs(work / "small") as mounted:
        out = rank_pool_2.run(cs.all_checks, str(work), str(work / "small"),
                              None if mounted else 20_000, assets, timeout=400)
    return {"ranks": out, "work": work, "mounted": mounted}


def test_async_save_is_byte_identical_and_resumes_bit_exactly(saves):
    for r in (x["engine"] for x in saves["ranks"]):
        assert r["returned"] is None  # the save returned before its files were written
        assert ".tmp-step_0000003" in r["during"] and "step_0000003" not in r["during"]
        assert r["pending_polls"] == [None, None]  # not published while a writer is busy
        assert r["async"] == r["sync"]  # every file, byte for byte (manifest included)
        assert sum("optim_states" in f for f in r["async"]) == 2
        assert r["resumed"] == r["uninterrupted"]  # bit for bit
    staging = [x["engine"]["staging_bytes"] for x in saves["ranks"]]
    params = saves["ranks"][0]["engine"]["params"]
    # dp rank 0 stages the fp32 module (4 B/param) and its half of the fp32 master + Adam m, v
    assert staging[0] == pytest.approx(4 * params + 12 * params / 2, rel=0.02)
    assert staging[1] == pytest.approx(12 * params / 2, rel=0.02)


def test_full_disk_leaves_no_partial_checkpoint(saves):
    r = saves["ranks"][0]["disk"]
    for name, step in (("sync", 2), ("async", 3)):
        text = r[name]
        assert text is not None, name
        assert f"checkpoint of step {step} could not be saved: rank " in text
        assert "writing " in text and f".tmp-step_000000{step}" in text
        assert f"The partial folder .tmp-step_000000{step} was removed" in text
        assert "the latest checkpoint is still step_0000001" in text
        if saves["mounted"]:
            assert "free of 4.0 MiB (the file system is full)" in text
        assert r[f"{name}_listing"] == ["latest", "step_0000001"]
        assert r[f"{name}_latest"] == "step_0000001"
    if saves["mounted"]:  # the asynchronous save failed in its writer thread, at an engine file
        assert re.search(r"writing \S+/\.tmp-step_0000003/(engine|rng)/\S+ failed", r["async"])
    assert r["continue"] is None  # on_save_error=continue: a warning, and training goes on
    assert any("could not be saved" in line and "training goes on" in line
               for line in r["continue_log"])
    assert r["continue_listing"] == ["latest", "step_0000001"]
    assert r["first_intact"] == []
    assert r["after"] > 0  # the engine trained on after the failed saves


def test_trainer_async_run_matches_sync_and_skips_a_damaged_checkpoint(saves):
    r = saves["ranks"][0]["trainer"]
    assert r["async"]["losses"] == r["sync"]["losses"]
    for step in (2, 4):
        a, b = r["files"]["async"][step], r["files"]["sync"][step]
        assert sorted(a) == sorted(b)
        # every file byte for byte, but the record of the run's config (checkpoint.async and
        # output_dir differ) and so its checksum in the manifest
        same = set(a) - {"trainer_state.json", "manifest.json"}
        assert all(a[f] == b[f] for f in same), [f for f in same if a[f] != b[f]]
        states = [json.loads(x["trainer_state.json"]) for x in (a, b)]
        assert states[0].pop("config")["checkpoint"]["async"] is True
        assert states[1].pop("config")["checkpoint"]["async"] is False
        assert states[0] == states[1]
        listed = [json.loads(x["manifest.json"])["files"] for x in (a, b)]
        assert [m.pop("trainer_state.json")["size"] for m in listed] == [
            len(a["trainer_state.json"]), len(b["trainer_state.json"])]
        assert listed[0] == listed[1], step
    auto, flipped = r["auto"], r["flipped"]
    assert auto["start"] == 2  # step 4 was damaged: resumed from step 2
    assert f"step_0000004 is damaged ({flipped}: xxh3_128" in auto["log"]
    assert auto["losses"][:2] == r["sync"]["losses"][2:]  # steps 3, 4 again, bit for bit
    assert "error" in r["named"] and "step_0000004' is damaged: " + flipped in r["named"]["error"]


def test_inspect_and_convert_need_nothing_but_the_checkpoint(saves, tmp_path):
    from toolkit.cli import app

    r = saves["ranks"][0]
    ckpt = Path(r["pretrain"]["checkpoint"])
    described = {p.name for p in (ckpt / "hf_config").iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= described, described
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", str(ckpt)])
    assert shown.exit_code == 0, shown.output
    assert "sizes and xxh3_128 checksums intact" in shown.output
    done = runner.invoke(app, ["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "hf" / "tokenizer.json").is_file() or (
        tmp_path / "hf" / "tokenizer_config.json").is_file()
    damaged = Path(r["trainer"]["damaged_copy"])  # the byte flipped in the async run's step 4
    bad = runner.invoke(app, ["inspect", str(damaged)])
    assert bad.exit_code == 1
    assert f"damaged: step_0000004/{r['trainer']['flipped']}: xxh3_128" in bad.output
