"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama with biases on q/k/v only.

Sliding-window layers (``use_sliding_window`` + ``max_window_layers``, read through HF's
``layer_types``) map to megatron-core's per-layer ``window_attn_skip_freq`` list.
"""

from __future__ import annotations

from model_adapters import register
from model_adapters.llama import Llama


@register
class Qwen2(Llama):
    architectures = ("Qwen2ForCausalLM",)
    qkv_bias_always = True
