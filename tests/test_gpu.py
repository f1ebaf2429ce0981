"""GPU subset: runs only where CUDA is present (the device machine), skipped on CPU."""

from __future__ import annotations

import pytest
import torch
from dist_checks import gpt_checks as gc

from toolkit.testing.distributed import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (runs on the device machine, not in CPU CI)"),
]


def test_cuda_logits_match_cpu_fp32():
    with RankPool(1, env={"MDTK_DEVICE": "cuda", "DS_ACCELERATOR": "cuda"}) as pool:
        (r,) = pool.run(gc.check_cuda_matches_cpu)
    assert r["max_abs"] < 1e-4, r
