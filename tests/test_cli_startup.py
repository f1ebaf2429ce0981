"""Start-up: each command imports only what it uses, in a fresh interpreter running ``mdtk``.

`mdtk inspect` and `mdtk convert` read config.json as plain JSON and name torch_dist keys from
the mapping, so neither transformers nor megatron-core is imported unless the command needs
them (an HF target writes config.json as JSON and copies generation_config.json); torch_dist's
``.metadata`` is read and written without ``torch.distributed.checkpoint`` (``dcp_pickle``:
DTensor, sympy); `mdtk --help`, `mdtk inspect` and `mdtk launch` (its config read) import
no torch, nor does a conversion between HF safetensors and torch_dist that copies bytes file
to file (no ``--dtype`` cast): dtypes go by name and ``torch.save``'s files are written by
``torch_record`` (both in ``toolkit.checkpoint.torchfree``).
scripts/bench_startup.py measures the times (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "megatron", "deepspeed", "torch.distributed.checkpoint")
PROBE = f"""
import json, runpy, sys
sys.argv = ["mdtk", *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module("toolkit.cli", run_name="__main__")
except SystemExit as e:
    code = e.code or 0
loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)
print("PROBE " + json.dumps(dict(exit=code, loaded=loaded)))
"""


def _loaded(*args: str) -> list[str]:
    """The heavy packages imported by ``mdtk ARGS`` (which must succeed)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert line.startswith("PROBE "), proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(line[len("PROBE "):])
    assert result["exit"] == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return result["loaded"]


def test_help_imports_no_torch():
    assert _loaded("--help") == []


def test_launch_reads_its_config_without_torch():
    """A launch agent reads the run's config (its schema names DPO's losses from the torch-free
    ``objectives.dpo.spec``) without megatron-core: ~3 CPU-s less in every agent, and
    `mdtk train --check` of a missing file says so in 0.4 s instead of 4.7 s."""
    assert _loaded("launch", "bundled:examples/pretrain_tiny.yaml", "--nodes", "1",
                   "--gpus-per-node", "2", "--dry-run") == []


def test_inspect_and_convert_import_neither_transformers_nor_megatron(tiny_root, tmp_path):
    src = tiny_root / "qwen2_moe"  # experts and dense layers: every key-naming path
    assert _loaded("inspect", str(src)) == []
    mcore = tmp_path / "mcore"
    # file to file both ways (no cast): not even torch (checkpoint.torchfree: dtypes, torch_record)
    assert _loaded("convert", str(src), str(mcore), "--to", "mcore", "--tp", "2", "-q") == []
    assert _loaded("inspect", str(mcore)) == []
    assert _loaded("convert", str(mcore), str(tmp_path / "back"), "--to", "hf", "-q") == []
    legacy = tmp_path / "legacy"
    assert _loaded("convert", str(mcore), str(legacy), "--to", "megatron-legacy", "--pp", "2",
                   "-q") == ["torch"]
    # an HF target writes config.json as JSON, copies generation_config.json: no transformers
    assert _loaded("convert", str(legacy), str(tmp_path / "hf"), "--to", "hf", "--verify",
                   "-q") == ["torch"]
