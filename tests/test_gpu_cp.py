"""Context parallelism on a GPU (the device machine; skipped on CPU, where
tests/test_context_parallel.py and tests/test_memory_activations.py check the CPU path): the CP
core attention's CUDA path
(SDPA with ``causal_lower_right``) against megatron-core's local attention, numerically and in
kernel time, and the model's logits at cp2 against transformers'.
"""

from __future__ import annotations

import pytest
import torch
from dist_checks import adapter_checks as ac
from dist_checks import cp_checks

from toolkit.runtime.rankpool import RankPool

CUDA_ENV = {"MDTK_DEVICE": "cuda", "DS_ACCELERATOR": "cuda"}
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (runs on the device machine, not in CPU CI)"),
]

REL = 1e-5  # fp32, TF32 off, relative to the largest output / gradient entry


def test_cuda_cp_attention_matches_megatron_and_is_faster():
    """At cp1 (one rank's CP group: chunks 0 and 1) the CP attention equals megatron-core's
    local DotProductAttention (fp32, 1024 tokens, GQA 8/2), and at 8192 tokens in bf16 (Llama-8B
    heads: 32/8 x 128) its forward + backward is faster than the local path, which builds the
    s x s scores."""
    with RankPool(1, env=CUDA_ENV) as pool:
        (exact,) = pool.run(cp_checks.core_attention_vs_megatron, 1024, timeout=600)
        (timed,) = pool.run(cp_checks.core_attention_vs_megatron, 8192, heads=32, groups=8,
                            dim=128, dtype="bf16", repeats=5, timeout=600)
    print(f"\nfp32 1024 tokens: {exact}\nbf16 8192 tokens: {timed}")
    assert exact["device"].startswith("cuda"), exact
    for name in ("SDPAttention", "CPAttention"):
        for part, err in exact[name].items():
            assert err <= REL * exact["scale"], (name, part, exact)
    ms = timed["ms"]
    assert ms["CPAttention"] < ms["DotProductAttention"], ms


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="cp2 needs 2 CUDA GPUs (NCCL: one rank per GPU)")
def test_cuda_logits_match_hf_at_cp2(tmp_path):
    """Dense and MoE families at cp2 on two GPUs (NCCL all-gather and reduce-scatter, SDPA's
    CUDA kernels) vs transformers' own model on CPU in fp32."""
    families = ["llama", "qwen3", "mixtral"]  # full attention: sliding windows refuse cp > 1
    ac.build_checkpoints(tmp_path, families)
    with RankPool(2, env=CUDA_ENV) as pool:
        ranks = pool.run(ac.check_cuda_logits, str(tmp_path), families, cp=2, timeout=600)
    for r in ranks:
        assert set(r) == set(families)
        bad = {f: v for f, v in r.items() if not v["max_abs"] <= 1e-4}
        assert not bad, bad
        assert {v["core"] for v in r.values()} == {"CPAttention"}, r
