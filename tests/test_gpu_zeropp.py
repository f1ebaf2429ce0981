"""GPU: ZeRO++'s quantized communication (qwZ int8 gathers, qgZ int4 reduction) on a real
DeepSpeed engine, where DeepSpeed has its quantizer kernels. On CPU mdtk refuses both with
DeepSpeed's reason (tests/test_zeropp.py); on one GPU qgZ falls back to a plain reduce-scatter
(DeepSpeed uses its all-to-alls only across nodes) while qwZ quantizes every gather."""

from __future__ import annotations

import pytest
import torch
from dist_checks import zeropp_checks as zc

from toolkit.runtime.rankpool import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (runs on the device machine, not in CPU CI)"),
]

QUANTIZED_RTOL = 0.02  # int8 parameter gathers on a tiny bf16 model: a loose, lossy bound


def test_quantized_comm_trains_close_to_plain_zero3():
    with RankPool(1, env={"MDTK_DEVICE": "cuda", "DS_ACCELERATOR": "cuda"}) as pool:
        (r,) = pool.run(zc.quantized_checks, timeout=600)
    plain, quantized = r["plain"]["losses"], r["quantized"]["losses"]
    assert quantized[-1] < quantized[0], quantized
    assert quantized == pytest.approx(plain, rel=QUANTIZED_RTOL), (quantized, plain)
