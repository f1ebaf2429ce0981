"""Runs that survive failures, with real torchrun agents and real killed workers (CPU, gloo).

Three launches, each scenario's assertions in its own test:

* two torchrun agents (``--nodes 2``, 1 process each, c10d rendezvous on 127.0.0.1, started
  through ``mdtk launch CONFIG --node-rank R``) train tp2 across the two nodes for 6 steps: the
  reference;
* one agent with 2 processes under ``--max-restarts 2``, saving asynchronously
  (``checkpoint.async: true``), that is made to fail twice: a worker is SIGKILLed from outside
  while its writer thread is inside the background save of step 4 (the restarted group resumes
  from step 2, never from the partial step 4), then a worker gets SIGTERM before step 5 (every
  rank saves step 5 and exits with status 75; the next restart resumes there). Its per-step
  losses equal the two-agent run's bit for bit, in every attempt;
* two processes under ``--max-restarts 1``, one hung on purpose (test hook),
  ``runtime.heartbeat_timeout_s=5``: the watchdogs end the group within the timeout, torchrun
  restarts it, and the stop file then makes every rank save and ``mdtk launch`` exit 75.

Two ranks per launch (12 worker starts in all, never more processes than this 2-core machine
has cores): the same paths as 2 x 2 and 1 x 4 (torchrun's ranks, c10d across agents, restarts,
the savers), at two thirds of the CPU.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from dist_checks import trainer_checks as tc

from toolkit import errors
from toolkit.runtime.ports import free_port
from toolkit.train.faults import TEST_FAULT_DIR_ENV, TEST_FAULT_ENV

pytestmark = pytest.mark.late  # see tests/conftest.py

STEPS, INTERVAL, HEARTBEAT_S = 6, 2, 5.0
TIMEOUT = 420


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny Llama, a tokenizer and the tp2 run's YAML (checkpoint every 2 steps, resume auto)."""
    import torch
    import transformers as tf

    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("faults")
    tok = build_tiny_tokenizer(root / "tokenizer", vocab_size=tc.TOKENIZER_VOCAB)
    torch.manual_seed(10)
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, eos_token_id=0,
        pad_token_id=1, bos_token_id=None), dtype=torch.float32)
    model.save_pretrained(root / "dense")
    assets = {"dense": str(root / "dense"), "tokenizer": str(tok), "cache": str(root / "cache")}
    case = tc.Case("tp2", tp=2, steps=STEPS, overrides=(
        f"checkpoint.interval={INTERVAL}", "checkpoint.resume=auto"))
    raw = tc.config(case, assets, root / "unset").to_dict()
    config = root / "tp2.yaml"
    config.write_text(yaml.safe_dump(raw))
    return {"root": root, "config": str(config)}


def _launch(setup: dict, name: str, flags: list[str], overrides: tuple[str, ...] = (),
            faults: str = "") -> tuple[subprocess.Popen, Path, Path]:
    """``mdtk launch CONFIG output_dir=... --master-port P FLAGS`` in the background."""
    out = setup["root"] / name
    out.mkdir(exist_ok=True)
    env = {**os.environ, TEST_FAULT_ENV: faults, TEST_FAULT_DIR_ENV: str(out)}
    log = out / f"launch-{len(list(out.glob('launch-*')))}.log"
    argv = [sys.executable, "-m", "toolkit.cli", "launch", setup["config"],
            f"output_dir={out}", *overrides, *flags]
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    return proc, out, log


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = TIMEOUT) -> int:
    """The pid a hooked rank wrote to ``path``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text():
            return int(path.read_text())
        assert proc.poll() is None, f"launch ended ({proc.returncode}) before {path.name}"
        time.sleep(0.1)
    raise AssertionError(f"{path.name} did not appear within {timeout} s")


def _metrics(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of every logged step, every attempt in order (metrics.jsonl appends)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


@pytest.fixture(scope="module")
def two_nodes(setup) -> dict:
    """Two agents, --nodes 2 --gpus-per-node 1, uninterrupted."""
    port = free_port()
    agents = [_launch(setup, "two_nodes", ["--nodes", "2", "--gpus-per-node", "1",
                                           "--node-rank", str(r), "--master-port", str(port)])
              for r in (1, 0)]  # node 1 first: c10d lets the nodes join in any order
    for proc, _, log in agents:
        assert proc.wait(TIMEOUT) == 0, log.read_text()[-3000:]
    out = agents[0][1]
    return {"losses": _metrics(out), "log": agents[1][2].read_text(), "out": out}


@pytest.fixture(scope="module")
def restarted(setup) -> dict:
    """One agent, 2 processes, --max-restarts 2, asynchronous saves; SIGKILL mid-save (in the
    writer thread), then SIGTERM."""
    faults = ",".join([
        "pause:save:1:4:0",  # attempt 0: rank 1's writer thread waits inside the save of step 4
        "pause:step:1:4:0",  # ... while its step loop waits before step 5 (logged steps fixed)
        "pause:step:1:4:1",  # attempt 1: rank 1 waits before step 5 (index 4)
    ])
    proc, out, log = _launch(setup, "restarted", ["--nodes", "1", "--gpus-per-node", "2",
                                                  "--max-restarts", "2", "--master-port",
                                                  str(free_port())],
                             overrides=("checkpoint.async=true",), faults=faults)
    seen: dict = {}
    try:
        pid = _wait_for(out / "pause-save-r1-s4-a0", proc)
        ckpt = out / "checkpoints"
        seen["during_save"] = sorted(p.name for p in ckpt.iterdir())
        os.kill(pid, signal.SIGKILL)
        pid = _wait_for(out / "pause-step-r1-s4-a1", proc)
        os.kill(pid, signal.SIGTERM)
        seen["status"] = proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    seen.update(losses=_metrics(out), log=log.read_text(), out=out)
    return seen


def test_two_agents_train_like_one(two_nodes, restarted):
    """--nodes 2 x 1 process (c10d) and 1 x 2 give the same tp2 losses, bit for bit."""
    ref = two_nodes["losses"]
    assert [s for s, _ in ref] == list(range(1, STEPS + 1))
    assert ref[-1][1] < ref[0][1] - 0.5  # it trains
    assert "2 x 1 = 2 ranks: dp=1 tp=2" in two_nodes["log"]
    final = dict(restarted["losses"])  # the last logged loss of each step
    assert [final[s] for s in range(1, STEPS + 1)] == [loss for _, loss in ref]


def test_sigkill_mid_save_resumes_from_last_complete_checkpoint(two_nodes, restarted):
    # while rank 1 was inside the save of step 4: only a temporary folder held step 4
    assert ".tmp-step_0000004" in restarted["during_save"]
    assert "step_0000004" not in restarted["during_save"]
    log = restarted["log"]
    assert "written in the background" in log  # checkpoint.async=true took effect
    assert "resumed from" in log and "step_0000002 at step 2" in log
    ref = dict(two_nodes["losses"])
    steps = [s for s, _ in restarted["losses"]]
    # attempt 0 logged 1-4 (killed while saving 4), attempt 1 resumed at 2 and redid 3-4
    assert steps[:4] == [1, 2, 3, 4] and steps[4:6] == [3, 4]
    for step, loss in restarted["losses"]:
        assert loss == ref[step], step  # every attempt, bit for bit


def test_sigterm_saves_then_resumes_bit_exactly(two_nodes, restarted):
    log = restarted["log"]
    assert "SIGTERM: saving a checkpoint and stopping at the next step boundary" in log
    # step 5 is not a checkpoint interval: the stop saved it, and the next attempt resumed there
    assert "saved checkpoint" in log and "step_0000005" in log
    assert "stopped at step 5 (SIGTERM on rank 1); checkpoint" in log
    assert "step_0000005 at step 5" in log
    assert restarted["status"] == 0
    steps = [s for s, _ in restarted["losses"]]
    assert steps[6:] == [5, 6]  # attempt 1 ran 5 and stopped; attempt 2 ran 6 only
    ckpts = sorted(p.name for p in (restarted["out"] / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_0000002", "step_0000004", "step_0000005", "step_0000006"]


def test_hung_rank_fails_fast_and_the_stop_file_stops_the_restarted_group(setup):
    """Attempt 0: rank 1 sleeps before step 2; every rank's watchdog ends the group
    HEARTBEAT_S after the last step and torchrun restarts it. Attempt 1: the stop file appears
    while rank 0 waits before step 2; step 2 is saved and `mdtk launch` exits 75."""
    proc, out, log = _launch(
        setup, "hung", ["--nodes", "1", "--gpus-per-node", "2", "--max-restarts", "1",
                        "--master-port", str(free_port())],
        overrides=("parallel.tp=1", f"runtime.heartbeat_timeout_s={HEARTBEAT_S}",
                   "checkpoint.interval=0"), faults="hang:step:1:1:0,pause:step:0:1:1")
    try:
        _wait_for(out / "hang-step-r1-s1-a0", proc)
        hung_at = time.monotonic()
        while "no training progress" not in log.read_text():
            assert time.monotonic() - hung_at < TIMEOUT and proc.poll() is None
            time.sleep(0.05)
        waited = time.monotonic() - hung_at
        _wait_for(out / "pause-step-r0-s1-a1", proc)
        (out / "STOP").touch()
        status = proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "no training progress for" in text and "heartbeat_timeout_s=5" in text
    assert re.search(rf"exitcode\s*:\s*{errors.EXIT_HUNG}\b", text), text[-2000:]
    # the last step ended just before the hang: the watchdog polls every 0.5 s
    assert HEARTBEAT_S - 0.5 < waited < HEARTBEAT_S + 2, waited
    assert status == errors.EXIT_STOPPED, text[-3000:]
    assert f"stopped at step 2 (stop file {out / 'STOP'}); checkpoint" in text
    assert f"remove {out / 'STOP'} and launch it again to resume (exit status 75)" in text
    assert "the ranks saved a checkpoint and stopped on request" in text
    assert (out / "checkpoints" / "step_0000002" / "trainer_state.json").is_file()
