"""Checkpoint manager: atomic folders, pruning, resume lookup, RNG round trip, resume checks,
and a real 2-rank DeepSpeed ZeRO-2 engine saved through it and resumed bit-exactly."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from dist_checks.checkpoint_save_checks import train_step, zero2_engine

from toolkit.parallel import ParallelLayout
from toolkit.train.checkpoints.folders import CheckpointManager
from toolkit.train.checkpoints.state import (
    ENGINE_TAG,
    STATE_FILE,
    ResumeError,
    TrainingState,
    capture_rng_state,
    check_resume,
    load_rng,
    load_training_state,
    restore_rng_state,
    rng_file,
    save_rng,
)


def _state(step: int, **kw) -> TrainingState:
    layout = kw.pop("layout", ParallelLayout().resolve(2))
    base = dict(step=step, consumed_samples=step * 8, world_size=layout.world_size,
                dp_size=layout.dp, global_batch=8, micro_batch=2, seed=1,
                layout=dataclasses.asdict(layout), data_fingerprint="abc",
                config={"train": {"steps": 10}})
    return TrainingState(**{**base, **kw})


def _write_engine(folder):
    (folder / ENGINE_TAG).mkdir()
    (folder / ENGINE_TAG / "weights.bin").write_bytes(b"w" * 100)


def test_save_layout_latest_and_state(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=0)
    assert mgr.resolve_resume("auto") is None  # nothing yet: fresh start
    path = mgr.save(_state(10), _write_engine)
    assert path.name == "step_0000010"
    assert sorted(p.name for p in path.iterdir()) == [ENGINE_TAG, "latest", "manifest.json", "rng",
                                                      STATE_FILE]
    assert (path / "latest").read_text() == ENGINE_TAG  # DeepSpeed's own tag pointer
    assert (path / ENGINE_TAG / "weights.bin").read_bytes() == b"w" * 100
    assert rng_file(path, 0).is_file()
    assert (mgr.root / "latest").read_text().strip() == "step_0000010"
    assert load_training_state(path) == _state(10)
    assert not list(mgr.root.glob(".tmp-*"))


def test_keep_last_and_resume_ignores_partial(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(_state(step))
    assert [s for s, _ in mgr.complete()] == [3, 4]
    # an interrupted save (temp folder) and a step folder without its state file are ignored
    (tmp_path / ".tmp-step_0000009").mkdir()
    (tmp_path / ".tmp-step_0000009" / STATE_FILE).write_text("{}")
    (tmp_path / "step_0000008").mkdir()
    assert mgr.resolve_resume("auto") == tmp_path / "step_0000004"
    assert mgr.resolve_resume("none") is None
    assert mgr.resolve_resume(str(tmp_path / "step_0000003")) == tmp_path / "step_0000003"
    with pytest.raises(ResumeError, match="not a complete checkpoint.*step_0000003"):
        mgr.resolve_resume(str(tmp_path / "step_0000008"))
    mgr.save(_state(5))  # the next save clears the leftover temp folder and prunes
    assert not (tmp_path / ".tmp-step_0000009").exists()
    assert [s for s, _ in mgr.complete()] == [4, 5]
    assert not list(tmp_path.glob(".deleting-*"))
    with pytest.raises(ResumeError, match="not a complete mdtk checkpoint"):
        load_training_state(tmp_path / "step_0000008")


def test_rng_round_trip_through_weights_only_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's legacy state
    save_rng(tmp_path, rank=3)
    want = (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    assert load_rng(tmp_path, rank=3) is True
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist()) == want
    assert load_rng(tmp_path, rank=4) is False  # saved with fewer ranks: the trainer reseeds
    # the file holds only tensors and plain values: loadable with weights_only=True
    torch.load(rng_file(tmp_path, 3), weights_only=True)
    state = capture_rng_state()
    a = torch.rand(2)
    restore_rng_state(state)
    assert torch.equal(torch.rand(2), a)


def test_check_resume_rules():
    layout = ParallelLayout(tp=2).resolve(4)  # dp=2
    state = _state(6, layout=layout)
    kw = dict(layout=layout, global_batch=8, seed=1, data_fingerprint="abc")
    check_resume(state, dp_change_ok=False, **kw)  # same run: fine
    dp4 = ParallelLayout(tp=2).resolve(8)
    check_resume(state, **{**kw, "layout": dp4}, dp_change_ok=True)
    with pytest.raises(ResumeError, match=r"dp=2, this run has dp=4.*Launch 4 ranks"):
        check_resume(state, **{**kw, "layout": dp4}, dp_change_ok=False)
    with pytest.raises(ResumeError, match="train.global_batch=8, this run has 16"):
        check_resume(state, **{**kw, "global_batch": 16}, dp_change_ok=True)
    with pytest.raises(ResumeError, match="train.seed=1, this run 2"):
        check_resume(state, **{**kw, "seed": 2}, dp_change_ok=True)
    with pytest.raises(ResumeError, match="fingerprint abc vs xyz"):
        check_resume(state, **{**kw, "data_fingerprint": "xyz"}, dp_change_ok=True)
    with pytest.raises(ResumeError, match="tp: 2 -> 1"):
        check_resume(state, **{**kw, "layout": ParallelLayout().resolve(4)}, dp_change_ok=True)
    # the trainer reshards the engine state (train.reshard): another layout is accepted, a
    # changed global batch, seed or data still refused
    tp1 = ParallelLayout().resolve(4)
    check_resume(state, **{**kw, "layout": tp1}, dp_change_ok=True, reshard_ok=True)
    with pytest.raises(ResumeError, match="train.global_batch=8, this run has 16"):
        check_resume(state, **{**kw, "layout": tp1, "global_batch": 16}, dp_change_ok=True,
                     reshard_ok=True)


# -- 2 real ranks: DeepSpeed ZeRO-2 engine checkpoint inside the manager's folders ------------
def _engine(seed: int):
    return zero2_engine(seed, width=8)


def _train_step(engine, k: int, rank: int) -> float:
    return train_step(engine, k, rank, width=8)


def rank_save_and_resume(root: str) -> dict:
    import torch.distributed as dist

    from toolkit import runtime

    runtime.prepare_deepspeed()
    rank = dist.get_rank()
    mgr = CheckpointManager(root, keep_last=1)
    engine = _engine(seed=0)

    def save(step):
        state = _state(step, layout=ParallelLayout().resolve(2), global_batch=4)
        return mgr.save(state, lambda d: engine.save_checkpoint(str(d), tag=ENGINE_TAG,
                                                                save_latest=False))

    for k in range(2):
        _train_step(engine, k, rank)
    save(1)
    _train_step(engine, 2, rank)
    torch.manual_seed(1000 + rank)
    path = save(3)
    uninterrupted = [_train_step(engine, k, rank) for k in (3, 4, 5)]
    engine.destroy()

    torch.manual_seed(77)  # different RNG and different initial weights before the resume
    resumed_engine = _engine(seed=5)
    where = mgr.resolve_resume("auto")
    load_path, _ = resumed_engine.load_checkpoint(str(where), tag=ENGINE_TAG)
    restored = load_rng(where, rank)
    resumed = [_train_step(resumed_engine, k, rank) for k in (3, 4, 5)]
    resumed_engine.destroy()
    dist.barrier()
    return {"uninterrupted": uninterrupted, "resumed": resumed, "restored": restored,
            "path": str(path), "where": str(where), "load_path": load_path,
            "listing": sorted(p.name for p in mgr.root.iterdir()),
            "engine_files": sorted(p.name for p in (where / ENGINE_TAG).iterdir()),
            "rng_files": sorted(p.name for p in (where / "rng").iterdir())}


def test_two_rank_deepspeed_save_resume_bit_exact(rank_pool_2, tmp_path):
    out = rank_pool_2.run(rank_save_and_resume, str(tmp_path / "ck"), timeout=300)
    for r in out:
        assert r["restored"] is True and r["load_path"] is not None
        assert r["resumed"] == r["uninterrupted"]  # bit-for-bit: engine + RNG restored
        assert r["where"] == r["path"] == str(tmp_path / "ck" / "step_0000003")
        assert r["listing"] == ["latest", "step_0000003"]  # keep_last=1 pruned step 1
        assert r["rng_files"] == ["rank_00000.pt", "rank_00001.pt"]
        # ZeRO-2 writes one optimizer partition per dp rank
        assert sum("optim_states" in f for f in r["engine_files"]) == 2
    assert out[0]["uninterrupted"] != out[1]["uninterrupted"]  # ranks saw different data
    state = json.loads((tmp_path / "ck" / "step_0000003" / STATE_FILE).read_text())
    assert state["step"] == 3 and state["dp_size"] == 2 and state["complete"] is True
