"""The CPU redirects must not change what other libraries compute in the same process."""

from __future__ import annotations

import torch
from dist_checks.hf_in_cpu_mode import hf_logits, make_tiny_llama


def test_transformers_models_unchanged_by_cpu_mode(tmp_path, rank_pool_2):
    # regression: wrapping torch factories before torch cached its device-constructor list made
    # transformers build RoPE buffers uninitialised under torch.device("meta") (silently wrong)
    path = make_tiny_llama(tmp_path / "tiny")
    ref = hf_logits(str(path))
    for got in rank_pool_2.run(hf_logits, str(path)):  # workers run with CPU mode enabled
        assert torch.equal(got, ref)
