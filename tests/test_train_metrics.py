"""Throughput figures: FLOPs per token (checked against real HF models), peak table, writer."""

from __future__ import annotations

import json
import math

import pytest
import torch

from toolkit import bundled
from toolkit.train.loop.metrics import (
    MetricsWriter,
    StepMetrics,
    gather_memory,
    matmul_params_per_token,
    memory_bytes,
    model_flops_per_token,
    peak_tflops,
    read_metrics,
    throughput,
)

TINY_LLAMA = json.loads(bundled.path(bundled.TINY_LLAMA_CONFIG).read_text())
TINY_MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=32,
                    intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100, num_local_experts=4,
                    num_experts_per_tok=2, tie_word_embeddings=False)


@pytest.mark.parametrize("name, want", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA A10G", None),
    ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0),
    ("AMD Instinct MI300X", 1307.0), ("NVIDIA B200", 2250.0), (None, None), ("cpu", None),
])
def test_peak_table(name, want):
    assert peak_tflops(name) == want


def test_peak_override():
    assert peak_tflops("NVIDIA H100 80GB HBM3", override=500) == 500.0
    assert peak_tflops(None, override=1.5) == 1.5


def _hf_counts(cfg: dict) -> tuple[int, int, int]:
    """(all params, input-embedding params, expert params) of the real HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, embed, experts


def test_flops_dense_llama_by_hand_and_against_hf():
    # per layer: q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*176 + 2 norms 2*64 = 46208
    n = 4 * 46208 + 64 + 512 * 64  # + final norm + untied lm_head
    from toolkit.memory.model import model_shape_from_hf

    assert matmul_params_per_token(model_shape_from_hf(TINY_LLAMA)) == n == 217664
    total, embed, _ = _hf_counts(TINY_LLAMA)
    assert total - embed == n  # the real model: every parameter but the embedding lookup
    shape = model_shape_from_hf(TINY_LLAMA)
    assert model_flops_per_token(shape, seq_len=128) == 6 * n + 12 * 4 * 64 * 128


def test_flops_moe_counts_active_experts_against_hf():
    total, embed, experts = _hf_counts(TINY_MIXTRAL)
    active = total - embed - experts + experts * 2 // 4  # top-2 of 4 experts
    assert active == 34336  # by hand: 2 * (3072 + 64 + 128 + 12288) + 32 + 3200
    from toolkit.memory.model import model_shape_from_hf

    shape = model_shape_from_hf(TINY_MIXTRAL)
    assert model_flops_per_token(shape, seq_len=16) == 6 * active + 12 * 2 * 32 * 16


def test_flops_tied_head_still_counted():
    tied = dict(TINY_LLAMA, tie_word_embeddings=True)
    from toolkit.memory.model import model_shape_from_hf

    assert matmul_params_per_token(model_shape_from_hf(tied)) == 217664
    total, embed, _ = _hf_counts(tied)
    assert total - embed + 512 * 64 == 217664


def test_throughput_math():
    t = throughput(tokens=1000, seconds=2.0, flops_per_token=1e9, num_devices=4, peak=100.0)
    assert t.tokens_per_s == 500.0
    assert t.tflops_per_device == pytest.approx(0.125)
    assert t.mfu == pytest.approx(0.00125)
    assert throughput(1000, 2.0, 1e9, 4, None).mfu is None
    with pytest.raises(ValueError, match="seconds=0"):
        throughput(1, 0.0, 1.0, 1, None)


def test_memory_is_measured():
    before = memory_bytes()
    assert before > 10 * 2**20  # a python process with torch loaded holds more than 10 MiB
    blob = torch.ones(64 * 2**20 // 4)  # +64 MiB touched
    assert memory_bytes() >= before and blob.sum() > 0
    assert gather_memory() == [memory_bytes()]


def test_writer_appends_flushes_and_tensorboard(tmp_path):
    rec = StepMetrics(step=1, loss=2.5, lr=1e-3, grad_norm=float("nan"), tokens_per_s=100.0,
                      tflops_per_device=None, mfu=None, mem_per_rank=[2**30, 2**31])
    with MetricsWriter(tmp_path, tensorboard=True) as w:
        w.log(rec)
        # flushed line by line: readable while the writer is open
        assert read_metrics(tmp_path) == [json.loads(rec.to_json())]
        w.log(StepMetrics(2, 2.0, 1e-3, 0.5, 110.0, 0.1, 0.001, [1, 2], val_loss=2.1))
    with MetricsWriter(tmp_path) as w:  # a resumed run appends
        w.log(StepMetrics(3, 1.5, 1e-3, 0.4, 120.0, None, None, [1, 2]))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["grad_norm"] is None  # NaN is not valid JSON: written as null
    assert rows[1]["val_loss"] == 2.1 and rows[0]["mem_per_rank"] == [2**30, 2**31]
    assert set(rows[0]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s",
                            "tflops_per_device", "mfu", "mem_per_rank"}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert losses == [(1, 2.5), (2, 2.0)]
    assert [e.value for e in acc.Scalars("train/mem_max_rank_gib")] == [2.0, 2**-30 * 2]
    assert math.isclose(acc.Scalars("train/val_loss")[0].value, 2.1, rel_tol=1e-6)
