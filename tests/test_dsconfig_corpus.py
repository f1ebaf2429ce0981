"""`mdtk ds-config --check` agrees with DeepSpeed's own parser on configs written by others.

The corpus (tests/data/ds_config_corpus/, sources in SOURCES.md) holds DeepSpeed's, transformers'
and accelerate's example and test configs. Each is judged at world sizes 1-8 by
``DeepSpeedConfig`` itself (its communication backend answering the world size, as on a real run;
HF "auto" values resolved as HF Trainer/accelerate would) and by ``ds-config --check``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from toolkit.cli import app
from toolkit.dsconfig import deepspeed_errors, lint, load_config
from toolkit.dsconfig.lint import _resolve_autos

ROOT = Path(__file__).resolve().parent.parent
CORPUS = sorted((ROOT / "tests/data/ds_config_corpus").glob("*.json"))
WORLDS = range(1, 9)


def deepspeed_accepts(cfg: dict, world: int) -> bool:
    """DeepSpeed's verdict: its parser with its communication backend reporting WORLD ranks."""
    import deepspeed.runtime.config as ds_config

    real = ds_config.dist
    ds_config.dist = SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda: world)
    try:
        ds_config.DeepSpeedConfig(_resolve_autos(cfg, world))
    except Exception:  # noqa: BLE001 - any rejection counts
        return False
    finally:
        ds_config.dist = real
    return True


def test_corpus_is_real_and_sourced():
    sources = (ROOT / "tests/data/ds_config_corpus/SOURCES.md").read_text()
    assert len(CORPUS) >= 20
    assert all(p.name in sources for p in CORPUS)


def test_check_agrees_with_deepspeed_at_every_world_size(tmp_path):
    runner = CliRunner()
    verdicts = {True: 0, False: 0}
    for path in CORPUS:
        cfg = load_config(path)
        pitfalls = lint(cfg, run_deepspeed=False).errors  # mdtk's own checks, world-free
        for world in WORLDS:
            accepted = deepspeed_accepts(cfg, world)
            verdicts[accepted] += 1
            ours = deepspeed_errors(cfg, world_size=world)
            assert (not ours) == accepted, (path.name, world, ours)
            report = lint(cfg, world_size=world)
            assert set(pitfalls) <= set(report.errors)  # mdtk's checks still run on top
            result = runner.invoke(app, ["ds-config", "--check", str(path),
                                         "--world-size", str(world)])
            assert result.exception is None or isinstance(result.exception, SystemExit), (
                path.name, world, result.exception)
            assert "Traceback" not in result.output
            assert result.exit_code == (0 if report.ok else 1), (path.name, world, result.output)
            if not accepted:
                lines = [line for line in result.output.splitlines() if line.startswith("error:")]
                assert any(e in line for e in ours for line in lines), result.output
    # the corpus exercises both verdicts, not just one
    assert verdicts[True] >= 60 and verdicts[False] >= 30, verdicts


@pytest.mark.parametrize("name,world,message", [
    # train_batch_size without micro batch: DeepSpeed derives micro = 4 // 8 = 0
    ("deepspeed_cifar.json", 8, "Micro batch size per gpu: 0 has to be greater than 0"),
    ("deepspeed_bingbertsquad_bsz24.json", 5, "24 != 3 * 1 * 5"),
    ("derived_cifar_quantize_training.json", 1, "quantize_training"),
    ("deepspeed_bing_bert_lamb_sparse_attention.json", 1, "sparse_attention"),
    ("deepspeed_autotuning_template_zero3.json", 2, "train_micro_batch_size_per_gpu"),
])
def test_known_rejections_in_plain_words(name, world, message):
    cfg = load_config(ROOT / "tests/data/ds_config_corpus" / name)
    errors = deepspeed_errors(cfg, world_size=world)
    assert any(message in e for e in errors), errors
    assert not deepspeed_accepts(cfg, world)


def test_hf_auto_batch_keys_resolve_at_every_world():
    cfg = load_config(ROOT / "tests/data/ds_config_corpus/accelerate_zero_stage3_offload.json")
    for world in WORLDS:
        assert deepspeed_errors(cfg, world_size=world) == []
        assert _resolve_autos(cfg, world)["train_batch_size"] == world  # micro 1 x gas 1 x world


def test_cli_subprocess_rejection_is_a_plain_error(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(load_config(
        ROOT / "tests/data/ds_config_corpus/derived_cifar_quantize_training.json")))
    done = subprocess.run([sys.executable, "-m", "toolkit.cli", "ds-config", "--check", str(path),
                           "--world-size", "4"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "error: DeepSpeed rejects the config" in done.stdout
    assert "quantize_training" in done.stdout
