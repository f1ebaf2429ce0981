"""Rank functions: transformers models loaded inside CPU-mode worker processes."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def hf_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    tokens = torch.arange(24).reshape(2, 12) % 128
    with torch.no_grad():
        return model(tokens).logits
