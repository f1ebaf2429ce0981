"""Asynchronous checkpoints on CUDA (issue 41): the host snapshot of a bf16 ZeRO-1 engine on the
GPU, written while the next steps run, gives the synchronous save's files byte for byte, and a
resume from it continues bit for bit (the CPU half: tests/test_checkpoint_saves.py)."""

from __future__ import annotations

import pytest
import torch
from dist_checks import checkpoint_save_checks as cs

from toolkit.runtime.rankpool import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (runs on the device machine, not in CPU CI)"),
]


def test_cuda_async_save_is_byte_identical_and_resumes_bit_exactly(tmp_path):
    with RankPool(1, env={"MDTK_DEVICE": "cuda", "DS_ACCELERATOR": "cuda"}) as pool:
        (r,) = pool.run(cs.async_matches_sync, str(tmp_path), 1024, 1, True, timeout=300)
    assert r["returned"] is None and r["loaded"]
    assert sorted(r["async"]) == sorted(r["sync"])
    differing = sorted(n for n in r["sync"] if r["async"][n] != r["sync"][n])
    assert not differing, r["why"]  # every file byte for byte, manifest included
    assert r["resumed"] == r["uninterrupted"]  # bit for bit
