"""Runs that survive failures, with real torchrun agents and real killed workers (CPU, gloo).

Three launches, each scenario's assertions in its own test:

* two Kubernetes "pods" (a JobSet of ``--nodes 2`` x 1 process written by ``mdtk launch
  --scheduler k8s``), each started with the manifest's command (``mdtk launch ... --in-pod``:
  a torchrun agent, c10d rendezvous on 127.0.0.1) and the environment the manifest and the
  controllers give it, train tp2 across the two "nodes" for 6 steps; the pod running rank 1 is
  killed before step 5 and both pods start again as the next restart attempt, which resumes
  from step 4: the two-agent reference;
* one agent with 2 processes under ``--max-restarts 2``, saving asynchronously
  (``checkpoint.async: true``), that is made to fail twice: a worker is SIGKILLed from outside
  while its writer thread is inside the background save of step 4 (the restarted group resumes
  from step 2, never from the partial step 4), then a worker gets SIGTERM before step 5 (every
  rank saves step 5 and exits with status 75; the next restart resumes there). Its per-step
  losses equal the pods' bit for bit, in every attempt (the two runs are interrupted and
  resumed at different steps; steps 1-4 run uninterrupted in both);
* two processes under ``--max-restarts 1``, one hung on purpose (test hook),
  ``runtime.heartbeat_timeout_s=5``: the watchdogs end the group within the timeout, torchrun
  restarts it, and the stop file then makes every rank save and ``mdtk launch`` exit 75.

Two ranks per launch (14 worker starts in all, never more processes than this 2-core machine
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
from dist_checks import k8s_pods
from dist_checks import trainer_checks as tc

from toolkit import errors
from toolkit.runtime.ports import free_port
from toolkit.train.loop.faults import TEST_FAULT_DIR_ENV, TEST_FAULT_ENV

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


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = TIMEOUT,
              logs: tuple[Path, ...] = ()) -> int:
    """The pid a hooked rank wrote to ``path``; a failure shows the end of ``logs``."""
    def said() -> str:
        return "".join(f"\n--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text():
            return int(path.read_text())
        assert proc.poll() is None, f"launch ended ({proc.returncode}) before {path.name}{said()}"
        time.sleep(0.1)
    raise AssertionError(f"{path.name} did not appear within {timeout} s{said()}")


def _metrics(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of every logged step, every attempt in order (metrics.jsonl appends)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


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
        pid = _wait_for(out / "pause-save-r1-s4-a0", proc, logs=(log,))
        ckpt = out / "checkpoints"
        seen["during_save"] = sorted(p.name for p in ckpt.iterdir())
        os.kill(pid, signal.SIGKILL)
        pid = _wait_for(out / "pause-step-r1-s4-a1", proc, logs=(log,))
        os.kill(pid, signal.SIGTERM)
        seen["status"] = proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    seen.update(losses=_metrics(out), log=log.read_text(), out=out)
    return seen


@pytest.fixture(scope="module")
def pods(setup) -> dict:
    """Two JobSet "pods" of 1 process each, started with the manifest's command and exactly the
    environment the manifest and the controllers give them (tests/dist_checks/k8s_pods.py): the
    completion index, the restart attempt, the first pod's DNS name mapped to 127.0.0.1 (and
    the rendezvous port to a free one), the ConfigMap's file where the command reads it.
    Attempt 0: the pod running rank 1 (its agent and rank) is SIGKILLed before step 5, as when
    its node is lost; JobSet then deletes the other pod (SIGTERM to its first process, SIGKILL
    after the grace period). Attempt 1: both pods again, as the next restart attempt."""
    from typer.testing import CliRunner

    from toolkit.cli import app

    root, name = setup["root"], "pods"
    out = root / name
    res = CliRunner().invoke(app, [
        "launch", setup["config"], f"output_dir={out}", f"data.sources=[{tc.PRETRAIN}]",
        "--nodes", "2", "--gpus-per-node", "1", "--scheduler", "k8s", "--k8s-kind", "jobset",
        "--image", "mdtk:test", "--volume", f"scratch:{root}", "--stop-minutes", "1",
        "--job-name", name, "--dry-run"])
    assert res.exit_code == 0, res.output
    docs = list(yaml.safe_load_all(res.stdout))
    job = k8s_pods.job_of(docs)
    argv = k8s_pods.pod_argv(job, k8s_pods.write_configmaps(docs, job, root / "configmaps"))
    grace = job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    hosts, port = {f"{name}-node-0-0.{name}": "127.0.0.1"}, free_port()
    out.mkdir()

    def start(index: int, attempt: int, faults: str = "") -> tuple[subprocess.Popen, Path]:
        env = {**os.environ, **k8s_pods.pod_env(job, index, attempt, hosts, port),
               TEST_FAULT_ENV: faults, TEST_FAULT_DIR_ENV: str(out)}
        log = out / f"pod{index}-attempt{attempt}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
        return proc, log

    first = [start(i, 0, "pause:step:1:4:0") for i in (1, 0)]  # c10d: any order
    again: list[tuple[subprocess.Popen, Path]] = []
    seen: dict = {"argv": argv}
    try:  # the pod running rank 1 (c10d numbers the ranks as the agents join) is lost
        paused = _wait_for(out / "pause-step-r1-s4-a0", first[0][0],
                           logs=tuple(log for _, log in first))
        (lost,) = [p for p, _ in first if paused in {q.pid for q in k8s_pods.pod_processes(p)}]
        k8s_pods.kill_pod(lost)
        (other,) = [p for p, _ in first if p is not lost]
        seen["deleted"] = k8s_pods.delete_pod(other, grace)  # JobSet deletes the others
        seen["attempt0"] = _metrics(out)
        again += [start(i, 1) for i in (0, 1)]
        seen["status"] = [proc.wait(TIMEOUT) for proc, _ in again]
    finally:
        for proc, _ in first + again:
            if proc.poll() is None:
                k8s_pods.kill_pod(proc)
    seen.update(losses=_metrics(out), logs=[log.read_text() for _, log in again],
                first_logs=[log.read_text() for _, log in first], out=out)
    return seen


def test_two_agents_train_like_one(pods, restarted):
    """Two pods (--nodes 2 x 1 process, c10d across their agents) and `mdtk launch -n 2` give
    the same tp2 losses, bit for bit."""
    ref = pods["losses"]
    assert [s for s, _ in ref] == list(range(1, STEPS + 1))
    assert ref[-1][1] < ref[0][1] - 0.5  # it trains
    assert any("2 x 1 = 2 ranks: dp=1 tp=2" in log for log in pods["first_logs"])
    final = dict(restarted["losses"])  # the last logged loss of each step
    assert [final[s] for s in range(1, STEPS + 1)] == [loss for _, loss in ref]


def test_killed_pod_restarts_as_the_next_attempt_and_resumes(pods):
    """The pod command reads its place from the pod's environment; the set started again with
    the next restart attempt's environment resumes from the last checkpoint (step 4)."""
    assert [s for s, _ in pods["attempt0"]] == [1, 2, 3, 4]  # lost before step 5
    assert pods["deleted"] != 0  # the other pod's group failed or was stopped, not finished
    assert pods["status"] == [0, 0], pods["logs"][0][-3000:]
    assert [s for s, _ in pods["losses"]][4:] == [5, 6]  # attempt 1 ran 5 and 6 only
    for index, log in zip((1, 0), pods["first_logs"], strict=True):
        assert f"JobSet pod: node {index} of 2, restart attempt 0, rendezvous 127.0.0.1:" in log
    log = pods["logs"][0]
    assert "JobSet pod: node 0 of 2, restart attempt 1, rendezvous 127.0.0.1:" in log
    assert "resumed from" in log and "step_0000004 at step 4" in log
    config = Path(pods["argv"][4])  # the ConfigMap's file, as the kubelet projects it
    assert config.name == "config.yaml" and config.parent.name == "mdtk-config"
    assert pods["argv"][-1] == "--in-pod"


def test_sigkill_mid_save_resumes_from_last_complete_checkpoint(pods, restarted):
    # while rank 1 was inside the save of step 4: only a temporary folder held step 4
    assert ".tmp-step_0000004" in restarted["during_save"]
    assert "step_0000004" not in restarted["during_save"]
    log = restarted["log"]
    assert "written in the background" in log  # checkpoint.async=true took effect
    assert "resumed from" in log and "step_0000002 at step 2" in log
    ref = dict(pods["losses"])
    steps = [s for s, _ in restarted["losses"]]
    # attempt 0 logged 1-4 (killed while saving 4), attempt 1 resumed at 2 and redid 3-4
    assert steps[:4] == [1, 2, 3, 4] and steps[4:6] == [3, 4]
    for step, loss in restarted["losses"]:
        assert loss == ref[step], step  # every attempt, bit for bit


def test_sigterm_saves_then_resumes_bit_exactly(pods, restarted):
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
        _wait_for(out / "hang-step-r1-s1-a0", proc, logs=(log,))
        hung_at = time.monotonic()
        while "no training progress" not in log.read_text():
            assert time.monotonic() - hung_at < TIMEOUT and proc.poll() is None
            time.sleep(0.05)
        waited = time.monotonic() - hung_at
        _wait_for(out / "pause-step-r0-s1-a1", proc, logs=(log,))
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
