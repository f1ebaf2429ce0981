"""Packed sequences on a GPU (issue 26; the device machine, skipped on CPU where
tests/test_packing.py checks exactness and docs/benchmarks.md records the CPU speed-up): the
varlen kernel keeps packed examples apart as SDPA per example does, and packing a length-skewed
SFT set at least doubles the loss tokens per second (``scripts/bench_packing.py``, small: 64
examples of median 512 tokens in rows of 4096, bf16, 3 alternating rounds). Run as its own
process: the bench builds its own single-rank process group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (runs on the device machine, not in CPU CI)"),
]


def test_cuda_packing_keeps_examples_apart_and_doubles_loss_tokens_per_s(tmp_path):
    out = tmp_path / "packing.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_packing.py"),
                           "--examples", "64", "--rounds", "3", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in res.items() if k not in ("model", "seconds")}, indent=1))
    agree = res["kernel_agreement"]
    if agree is not None:  # a varlen kernel ran: bf16 against SDPA per example in fp32
        assert agree["max_abs_diff_vs_sdpa_per_example_fp32"] < 0.05, agree
    assert res["packed_padding_fraction"] < 0.2 < 0.5 < res["unpacked_padding_fraction"], res
    assert res["speedup_median"] >= 2.0, res
