"""``scripts/check_megatron_lm_training.py``: Megatron-LM's own ``pretrain_gpt.py`` and ``mdtk
train`` give the same first 10 losses on the same indexed data, at dp2 and at tp2; and ``mdtk data
preprocess`` writes the bytes of Megatron-LM's real ``tools/preprocess_data.py`` (one worker,
several, shards merged).

Both need a Megatron-LM source checkout (``MEGATRON_LM_CHECKOUT``, tag core_v0.16.1); CI has no
network to fetch one, so they are skipped there. Without one, the run settings the script gives
the two trainers are checked to be the same settings.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_checks import load_script

from toolkit import bundled

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_megatron_lm_training.py"
CHECKOUT = os.environ.get("MEGATRON_LM_CHECKOUT")
NEEDS_CHECKOUT = pytest.mark.skipif(
    not CHECKOUT, reason="MEGATRON_LM_CHECKOUT is not set: point it at a Megatron-LM source "
    "checkout at the tag matching megatron-core (core_v0.16.1); CI has no network to fetch one")


def _script():
    return load_script("check_megatron_lm_training")


def _flag_values(flags: list[str]) -> dict[str, str]:
    out = {}
    for i, f in enumerate(flags):
        if f.startswith("--"):
            nxt = flags[i + 1] if i + 1 < len(flags) else ""
            out[f[2:]] = nxt if nxt and not nxt.startswith("--") else "true"
    return out


def test_both_trainers_get_the_same_run_settings(tmp_path):
    s = _script()
    hf_config = json.loads(bundled.path(bundled.TINY_LLAMA_CONFIG).read_text())
    prefixes = [str(tmp_path / "a"), str(tmp_path / "b")]
    for layout, tp in (("dp2", 1), ("tp2", 2)):
        flags = s.megatron_flags(hf_config, tmp_path / "hf", tmp_path / "ckpt", prefixes, tp,
                                 tmp_path / "cache")
        f = _flag_values(flags)
        c = s.mdtk_config(tmp_path / "hf", prefixes, tp, tmp_path / "run", tmp_path / "cache")
        o, t, d = c["optim"], c["train"], c["data"]
        assert flags.count("--seq-length") == 1, layout  # one sequence length, the run's
        assert (int(f["micro-batch-size"]), int(f["global-batch-size"]), int(f["seq-length"]),
                int(f["train-iters"]), int(f["seed"])) == \
            (t["micro_batch"], t["global_batch"], t["seq_len"], t["steps"], t["seed"])
        assert (float(f["lr"]), float(f["min-lr"]), float(f["weight-decay"]),
                float(f["adam-beta1"]), float(f["adam-beta2"]), float(f["adam-eps"]),
                float(f["clip-grad"])) == \
            (o["lr"], o["min_lr"], o["weight_decay"], *o["betas"], o["eps"], o["clip_grad"])
        assert f["lr-decay-style"] == o["decay"] == "constant"
        assert int(f["lr-warmup-iters"]) == o["warmup_steps"] == 0
        assert int(f["tensor-model-parallel-size"]) == c["parallel"]["tp"] == tp
        at = flags.index("--data-path")
        assert flags[at + 1:at + 5] == [str(d["weights"][0]), prefixes[0],
                                        str(d["weights"][1]), prefixes[1]]
        assert f["split"] == "100,0,0" and d["validation_split"] == 0.0
        assert t["precision"] == "fp32" and "bf16" not in f and "fp16" not in f
        assert f["attention-dropout"] == f["hidden-dropout"] == "0.0"


@pytest.mark.slow
@NEEDS_CHECKOUT
def test_megatron_lm_and_mdtk_train_to_the_same_losses(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), CHECKOUT, "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = re.findall(r"^(PASS|FAIL) (\w+): first 10 losses max rel diff (\S+) \(tol 0.0001\); "
                      r"tokens/s Megatron-LM ([\d,]+) mdtk ([\d,]+)$", done.stdout, re.M)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert [r[1] for r in rows] == ["dp2", "tp2"], done.stdout
    assert all(r[0] == "PASS" and float(r[2]) <= 1e-4 for r in rows), rows


@NEEDS_CHECKOUT
def test_preprocess_equals_the_real_preprocess_data_py(tmp_path):
    """Megatron-LM's tool at 2 workers; mdtk at 1 and 3 workers and as 3 shards merged."""
    from toolkit.train.data.indexed_format import merge
    from toolkit.train.data.preprocess import TokenizeSpec, preprocess
    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    s = _script()
    tok = build_tiny_tokenizer(tmp_path / "tok")
    corpus = tmp_path / "c.jsonl"
    lines = (bundled.path(bundled.DATA) / "pretrain.jsonl").read_text().splitlines(True)
    extra = ["", " ", "é 中文 🙂", "a<|endoftext|>b", "line\n\nbreak"]
    corpus.write_text("".join(lines[:400]) + "".join(json.dumps({"text": t}) + "\n"
                                                     for t in extra))
    done = subprocess.run(s.megatron_preprocess_cmd(Path(CHECKOUT), [str(corpus)], tok,
                                                    str(tmp_path / "mlm"), 2),
                          env=s.preprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = tmp_path / "mlm_text_document"
    spec = TokenizeSpec(str(tok), append_eod=True)
    outs = [preprocess([str(corpus)], spec, str(tmp_path / f"w{w}"), workers=w, batch_docs=64,
                       progress=False).outputs["text"] for w in (1, 3)]
    shards = [preprocess([str(corpus)], spec, str(tmp_path / "sh"), shard=(i, 3), batch_docs=64,
                         progress=False).outputs["text"] for i in range(3)]
    merge(shards, tmp_path / "merged")
    for ours in (*outs, str(tmp_path / "merged")):
        for ext in ("bin", "idx"):
            assert filecmp.cmp(f"{ours}.{ext}", f"{ref}.{ext}", shallow=False), (ours, ext)
