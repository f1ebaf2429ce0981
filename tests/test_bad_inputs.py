"""Bad input is one `error:` line, never a traceback, and writes nothing (issue 43).

The cases a new user hit (each a traceback before): `mdtk verify` of a damaged safetensors
header, a truncated file, a tensor of the wrong shape; `mdtk estimate` / `ds-config --model` /
`plan` of a config.json with a wrong type; `mdtk train` as one plain process (no launcher) on
damaged models, and on the demo's valid one, where it trains and exports as a 1-rank launch does.
The property-based half (hypothesis, derandomized: a failure replays) mutates real inputs and
runs every command that reads them, in this process: test_bad_inputs_fuzz.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_checks import bad_input_checks as bic
from dist_checks.bad_input_checks import mdtk

from toolkit.errors import EXIT_STATUS
from toolkit.runtime import LAUNCH_ENV

ROOT = Path(__file__).resolve().parent.parent

#: What the error line must name for each damage: the file or key, what is wrong, the fix.
SAYS = {
    "header": ("model.safetensors", "not a readable safetensors file", "download the file again"),
    "truncated": ("model.safetensors", "is truncated", "download the file again"),
    "shape": ("model.layers.0.mlp.down_proj.weight", "stored (64, 170), expected (64, 176)",
              "must be of the same model"),
    "type": ("config.json", "'hidden_size'", '"sixty-four" (a string)', "positive integer",
             "correct that value"),
}


@pytest.fixture(scope="module")
def damaged(demo_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("damaged")
    return {how: bic.damage(demo_model, root / how, how) for how in SAYS}


def assert_one_error(outcome: bic.Outcome, says: tuple[str, ...], *unwritten: Path) -> None:
    assert outcome.code != 0, outcome
    assert "Traceback" not in outcome.text, outcome.text
    assert len(outcome.errors) == 1, outcome.text
    for words in says:
        assert words in outcome.errors[0], (words, outcome.errors[0])
    for path in unwritten:
        assert not path.exists(), path


@pytest.mark.parametrize("how", ["header", "truncated", "shape", "type"])
def test_verify_names_the_damage(demo_model, damaged, how):
    outcome = mdtk("verify", str(demo_model), str(damaged[how]))
    assert outcome.code == 2
    assert_one_error(outcome, SAYS[how])


@pytest.mark.parametrize("command", [["estimate"], ["ds-config", "-o", "{out}/ds.json"],
                                     ["plan", "--emit", "{out}/plan"]])
def test_model_commands_name_a_wrong_type(damaged, tmp_path, command):
    argv = [a.format(out=tmp_path) for a in command]
    outcome = mdtk(*argv, "--model", str(damaged["type"]))
    assert_one_error(outcome, SAYS["type"] + (str(damaged["type"] / "config.json"),))
    assert list(tmp_path.iterdir()) == []  # nothing written


# -- `mdtk train` as one plain process -------------------------------------------------------

@pytest.fixture(scope="module")
def one_process(rank_pool_1, demo_model, damaged, tmp_path_factory):
    """One process without a launcher's environment runs `mdtk train` on each damaged model
    (refused), on a layout that needs 2 ranks (refused), then on the valid model (trains);
    meanwhile the session's 1-rank pool (the launcher's environment) trains the same valid
    config."""
    root = tmp_path_factory.mktemp("one_process")
    cases = [{"name": how, "argv": bic.train_argv(folder, root / f"run_{how}")}
             for how, folder in damaged.items()]
    cases.append({"name": "tp2", "argv": [*bic.train_argv(demo_model, root / "run_tp2"),
                                          "parallel.tp=2"]})
    cases.append({"name": "valid", "argv": bic.train_argv(demo_model, root / "plain")})
    (root / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items()
           if k not in (*LAUNCH_ENV, "LOCAL_WORLD_SIZE", "SLURM_PROCID", "MDTK_DEBUG")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "dist_checks.bad_input_checks",
                             str(root / "cases.json"), str(root / "results.json")],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        # the same run in the launcher's environment, meanwhile
        (reference,) = rank_pool_1.run(bic.train_reference,
                                       bic.train_argv(demo_model, root / "launched"), timeout=600)
        log, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    results = json.loads((root / "results.json").read_text())
    return {"root": root, "log": log, "code": proc.returncode, "reference": reference,
            "refused": {k: bic.Outcome(**v) for k, v in results.items()}}


@pytest.mark.parametrize("how", ["header", "truncated", "shape", "type"])
def test_train_one_process_names_the_damage(one_process, how):
    outcome = one_process["refused"][how]
    assert outcome.code == EXIT_STATUS
    assert_one_error(outcome, SAYS[how], one_process["root"] / f"run_{how}")


def test_train_one_process_says_how_to_start_more_ranks(one_process):
    outcome = one_process["refused"]["tp2"]
    assert_one_error(outcome, ("tp*pp*cp = 2*1*1 = 2", "the layout needs 2 ranks",
                               "`mdtk launch -n 2 -- train"), one_process["root"] / "run_tp2")


def test_train_one_process_trains_like_a_one_rank_launch(one_process):
    """`mdtk train bundled:examples/sft_tiny.yaml parallel.tp=1 parallel.pp=1` without a
    launcher: the losses of the 1-rank launch, bit for bit (both one thread), and the same
    export, checked against the trained model."""
    from safetensors.torch import load_file

    log, ref, root = one_process["log"], one_process["reference"], one_process["root"]
    assert one_process["code"] == 0, log[-3000:]
    assert "Traceback" not in log and "error:" not in log, log[-3000:]
    assert "1 ranks (one process: no launcher)" in log, log[-3000:]
    losses = [json.loads(line)["loss"] for line in
              (root / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses  # it trains
    assert losses == ref["losses"]
    summary = json.loads((root / "plain" / "summary.json").read_text())
    assert summary["export_max_abs_diff"] < 1e-4 and ref["export_diff"] < 1e-4
    mine, theirs = load_file(root / "plain" / "hf" / "model.safetensors"), \
        load_file(Path(ref["export_dir"]) / "model.safetensors")
    assert sorted(mine) == sorted(theirs) and len(mine) > 30
    assert all(mine[k].equal(theirs[k]) for k in mine)
