"""``scripts/check_megatron_lm.py``: Megatron-LM's own ``load_checkpoint`` on mdtk's output.

The full check needs a Megatron-LM source checkout (``MEGATRON_LM_CHECKOUT``, tag matching the
installed megatron-core); CI has no network to fetch one, so it is skipped there and costs
nothing. The launch flags it derives are checked without one, against the ``args`` Megatron-LM
stored for the fixture's model (the same Llama, launched by Megatron-LM itself).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_checks import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_megatron_lm.py"
MLM = ROOT / ".." / "shared" / "fixtures" / "megatron-lm-core_v0.16.1"


def _script():
    return load_script("check_megatron_lm")


@pytest.mark.skipif(not MLM.is_dir(), reason=f"fixtures not found at {MLM}")
def test_llama_flags_are_the_ones_megatron_lm_ran_with():
    import json

    from toolkit.checkpoint.torchfree.safe_load import load_torch

    config = json.loads((MLM / "hf-llama-tiny" / "config.json").read_text())
    flags = _script().model_flags(config, MLM / "hf-llama-tiny")
    theirs = vars(load_torch(MLM / "torch_dist-tp2" / "iter_0000007" / "common.pt")["args"])
    given: dict[str, object] = {}
    for i, f in enumerate(flags):
        if f.startswith("--"):
            value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") \
                else True
            given[f[2:].replace("-", "_")] = value
    given["add_bias_linear"] = not given.pop("disable_bias_linear")
    given["layernorm_epsilon"] = given.pop("norm_epsilon")  # Megatron-LM's dest for the flag
    skip = {"seq_length", "tokenizer_model"}  # run settings: the check's own sequence / folder
    wrong = {k: (v, theirs.get(k)) for k, v in given.items()
             if k not in skip and str(theirs.get(k)) != str(v)
             and not (isinstance(theirs.get(k), float) and float(v) == theirs[k])}
    assert wrong == {}, f"flag values differing from Megatron-LM's run (ours, theirs): {wrong}"
    assert given["rotary_base"] == "500000" and given["ffn_hidden_size"] == "96"


CHECKOUT = os.environ.get("MEGATRON_LM_CHECKOUT")


@pytest.mark.slow
@pytest.mark.skipif(not CHECKOUT, reason="MEGATRON_LM_CHECKOUT is not set: point it at a "
                    "Megatron-LM source checkout at the tag matching megatron-core (core_v0.16.1); "
                    "CI has no network to fetch one")
def test_megatron_lm_loads_mdtk_output(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), CHECKOUT, "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = re.findall(r"^(PASS|FAIL) (\S+)\s+(\S+)\s+logits max abs diff (\S+)", done.stdout,
                      re.M)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert sorted((fmt, mode) for _, fmt, mode, _ in rows) == [
        ("torch", "checkpoint-args"), ("torch", "explicit"),
        ("torch_dist", "checkpoint-args"), ("torch_dist", "explicit")]
    assert all(verdict == "PASS" and float(diff) <= 1e-4 for verdict, _, _, diff in rows), rows
