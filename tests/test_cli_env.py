"""`mdtk --help` and `mdtk env` work from the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def _mdtk(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("mdtk")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "toolkit.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_help_lists_commands():
    out = _mdtk("--help")
    assert out.returncode == 0, out.stderr
    assert "env" in out.stdout


def test_env_json_reports_versions_device_backend():
    out = _mdtk("env", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    import deepspeed
    import megatron.core
    import torch

    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["deepspeed"] == deepspeed.__version__
    assert report["versions"]["megatron-core"] == megatron.core.__version__
    if torch.cuda.is_available():
        pytest.skip("CPU-mode assertions only apply without CUDA")
    assert report["device"] == "cpu"
    assert report["backend"] == "gloo"
    assert any("current_device" in p for p in report["cpu_patches"])
    assert set(report["optional"]) >= {"transformer_engine", "apex", "deepspeed cpu_adam",
                                       "deepspeed async_io (NVMe)"}
