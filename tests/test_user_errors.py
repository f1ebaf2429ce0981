"""User errors are said once: `mdtk train` on 2 real ranks (torchrun through `mdtk launch`) with a
malformed JSON Lines line prints one `error:` line,
no traceback, and fails with the user-error status; a rank that fails alone stops every rank (no
hang); `--debug` / MDTK_DEBUG=1 brings the traceback back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit import bundled
from toolkit.errors import EXIT_STATUS, UserError

ROOT = Path(__file__).resolve().parent.parent


def _launch_train(model: Path, out: Path, source: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "toolkit.cli", "launch", "-n", "2", "--master-port", "0", "--",
            "train", bundled.SFT_EXAMPLE, f"output_dir={out}", f"model.path={model}",
            f"export.hf_dir={out / 'hf'}", "checkpoint.resume=none", f"data.sources=[{source}]"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MDTK_DEBUG", None)
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.late  # a torchrun launch: runs after the background async_io build (conftest)
def test_data_errors_on_two_ranks_are_one_line(demo_model, tmp_path):
    """One launch: the malformed line's error, raised on both ranks, is printed once.

    What each data error says (missing file, malformed line, unknown row shape) is asserted
    in-process by tests/test_train_data.py; this launch shows the multi-rank path around any of
    them: one `error:` line from rank 0, no traceback, the user-error status from every rank."""
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"prompt": "2+2?", "response": "4"}\n{"prompt": "3+3?", "response": \n')
    proc = _launch_train(demo_model, tmp_path / "run-malformed", malformed)
    text, _ = proc.communicate(timeout=600)
    lines = [x for x in text.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, text[-4000:]  # once, from rank 0, not once per rank
    for w in (f"{malformed}:2:", "not valid JSON", "fix or remove the line"):
        assert w in lines[0], (w, lines[0])
    assert "Traceback" not in text and "[rank" not in text, text[-4000:]
    assert "DataError" not in text, text[-4000:]
    assert proc.returncode == EXIT_STATUS, text[-4000:]  # every rank: torchrun failed


def test_debug_shows_the_traceback(tmp_path):
    """Single process (no ranks): `mdtk train --check` on a missing config."""
    missing = str(tmp_path / "nope.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MDTK_DEBUG", None)

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "toolkit.cli", *args], cwd=ROOT,
                              env={**env, **extra}, capture_output=True, text=True, timeout=120)

    plain = run("train", missing, "--check")
    assert plain.returncode == EXIT_STATUS
    assert plain.stderr.count("error:") == 1 and "nope.yaml" in plain.stderr
    assert "Traceback" not in plain.stderr
    for debug in (run("--debug", "train", missing, "--check"),
                  run("train", missing, "--check", MDTK_DEBUG="1")):
        assert debug.returncode != 0
        assert "Traceback" in debug.stderr and "ConfigError" in debug.stderr, debug.stderr


def _fail_on(rank_to_fail: int, kind: str) -> dict:
    """Rank ``rank_to_fail`` raises inside ``failing_together``; every rank reports what it got.
    Then one more collective, which would hang if any rank had been left behind."""
    import torch
    import torch.distributed as dist

    from toolkit import runtime
    from toolkit.train.data import DataError

    got = None
    try:
        with runtime.failing_together():
            if dist.get_rank() == rank_to_fail:
                raise DataError("bad row") if kind == "user" else KeyError("bug")
    except Exception as e:  # what this rank would report
        got = {"type": type(e).__name__, "message": str(e), "user": isinstance(e, UserError)}
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank is here: nobody waits in a collective the others left
    return {"got": got, "sum": float(t[0])}


@pytest.mark.parametrize("kind", ["user", "bug"])
def test_a_rank_failing_alone_stops_every_rank(rank_pool_2, kind):
    out = rank_pool_2.run(_fail_on, 1, kind, timeout=120)
    assert [r["sum"] for r in out] == [2.0, 2.0]
    if kind == "user":  # rank 0 raises rank 1's error as it is, so it can report it
        assert [r["got"] for r in out] == [{"type": "DataError", "message": "bad row",
                                            "user": True}] * 2
    else:  # a bug: rank 1 keeps its own, rank 0 names rank 1
        assert out[1]["got"]["type"] == "KeyError"
        assert out[0]["got"] == {"type": "RuntimeError", "message": "rank 1 failed: KeyError: "
                                 "'bug'", "user": False}


def test_rank_env_sets_threads_per_rank():
    from toolkit.launch import LaunchSpec, rank_env

    assert rank_env(LaunchSpec(4), {}, cores=16)["OMP_NUM_THREADS"] == "4"
    assert rank_env(LaunchSpec(4), {}, cores=2)["OMP_NUM_THREADS"] == "1"
    assert rank_env(LaunchSpec(2), {"OMP_NUM_THREADS": "7"}, cores=16)["OMP_NUM_THREADS"] == "7"
    assert json.loads(json.dumps(rank_env(LaunchSpec(1), {"A": "b"}, cores=3))) == {
        "A": "b", "OMP_NUM_THREADS": "3"}
