"""GPU subset: runs only where CUDA is present (the device machine), skipped on CPU."""

from __future__ import annotations

import pytest
import torch
from dist_checks import adapter_checks as ac

from toolkit.runtime.rankpool import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (runs on the device machine, not in CPU CI)"),
]

TOL = 1e-4  # fp32, TF32 off: the same bound as the CPU adapter tests

#: The core attention each family must get on CUDA (``auto`` -> SDPA). DeepSeek-V3 uses
#: multi-latent attention: megatron-core's MLA hands the core attention ``k_channels`` /
#: ``v_channels`` (q/k head size != v head size), so it gets the SDPA subclass that accepts them
#: (toolkit.models.attention._latent); every other family uses plain SDPA. A family falling back
#: to megatron-core's local DotProductAttention on the GPU would be a regression.
LATENT = {"deepseek_v3", "kimi_k2"}  # Kimi K2: DeepSeek-V3's architecture
#: Llama 4's chunked / NoPE-temperature attention wraps the same SDPA core attention.
WRAPPED = {"llama4": "Llama4"}


def expected_core(family: str) -> str:
    return WRAPPED.get(family, "") + ("LatentSDPAttention" if family in LATENT else "SDPAttention")


def expected_delta_kernels() -> str:
    """Qwen3-Next's gated DeltaNet on CUDA: fla + causal-conv1d where both are installed."""
    import importlib.util

    have = all(importlib.util.find_spec(m) for m in ("fla", "causal_conv1d"))
    return "causal-conv1d + fla" if have else "torch"


def test_cuda_logits_match_hf_every_family(tmp_path):
    """Every adapter family on the GPU (nccl, SDPA attention, no CPU redirects) vs transformers'
    own model on CPU in fp32: the numerical reference of the whole project."""
    families = [*ac.tiny_configs(), *ac.tiny_moe_configs(), *ac.tiny_open_moe_configs()]
    ac.build_checkpoints(tmp_path)  # this process: HF references on CPU, before any CPU mode
    with RankPool(1, env={"MDTK_DEVICE": "cuda", "DS_ACCELERATOR": "cuda"}) as pool:
        (r,) = pool.run(ac.check_cuda_logits, str(tmp_path), families, timeout=600)
    assert set(r) == set(families)
    bad = {f: v for f, v in r.items() if not v["max_abs"] <= TOL}
    assert not bad, bad
    cores = {f: v["core"] for f, v in r.items()}
    assert cores == {f: expected_core(f) for f in families}, cores
    assert r["qwen3_next"]["delta"] == expected_delta_kernels()
