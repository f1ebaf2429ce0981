"""The choice of fused kernels (``train.fused_kernels``, toolkit/models/kernels.py): what
``auto`` takes where, what a named list is refused for, and the TransformerConfig flags each
kernel sets for which activations. Their numerics: tests/test_gpu_kernels.py (CUDA)."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from toolkit.errors import ConfigError
from toolkit.models.kernels import Kernels, parse, select

CUDA = dict(cuda=True, tp=1, token_mean=True, bf16=True, liger=True)


def test_auto_takes_the_fused_swiglu_on_cuda_only():
    kernels, line = select("auto", **CUDA)
    assert kernels == Kernels(swiglu=True)  # measured faster and smaller (the module's notes)
    assert line == "fused kernels: swiglu"
    kernels, line = select("auto", **{**CUDA, "cuda": False})
    assert kernels == Kernels() and line == "fused kernels: none; not swiglu (needs CUDA)"
    assert select("off", **CUDA)[0] == Kernels()


def test_named_kernels_and_why_each_is_refused():
    kernels, _ = select("swiglu, linear_cross_entropy", **CUDA)
    assert kernels == Kernels(swiglu=True, linear_cross_entropy=True)
    # the fused linear loss replaces the fused cross-entropy where both are named
    assert select("cross_entropy,linear_cross_entropy", **CUDA)[0] == Kernels(
        linear_cross_entropy=True)
    for setting, where, words in [
        ("linear_cross_entropy", {"tp": 2}, "vocab-parallel at tp=2"),
        ("linear_cross_entropy", {"token_mean": False}, "not the token mean"),
        ("linear_cross_entropy", {"liger": False}, "pip install liger-kernel"),
        ("cross_entropy", {"bf16": False}, "rounds its gradient to bf16"),
        ("swiglu", {"cuda": False}, "needs CUDA"),
    ]:
        with pytest.raises(ConfigError, match=words):
            select(setting, **{**CUDA, **where})
    with pytest.raises(ConfigError, match="unknown kernel 'rope'"):
        parse("swiglu,rope")


def test_config_flags_follow_the_activation():
    swiglu = Kernels(swiglu=True)
    plain = dict(gated_linear_unit=True, activation_func=F.silu)
    assert swiglu.config_flags(plain) == {"bias_activation_fusion": True}
    assert swiglu.config_flags({**plain, "activation_func": F.gelu}) == {
        "bias_activation_fusion": True}  # GeGLU (Gemma 3)
    for other in ({"gated_linear_unit": False}, {"activation_func_clamp_value": 7.0},
                  {"glu_linear_offset": 1.0}, {"num_moe_experts": 4}):
        assert swiglu.config_flags({**plain, **other}) == {}, other
    assert Kernels(cross_entropy=True).config_flags(plain) == {
        "cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"}


def test_the_trainer_config_refuses_an_unknown_kernel_before_anything_runs():
    from toolkit.train.config import load_config

    assert load_config("bundled:examples/pretrain_tiny.yaml").train.fused_kernels == "auto"
    with pytest.raises(ConfigError, match="train.fused_kernels: unknown kernel 'fast'"):
        load_config("bundled:examples/pretrain_tiny.yaml", ["train.fused_kernels=fast"])
