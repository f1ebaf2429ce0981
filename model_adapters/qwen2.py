"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama with biases on q/k/v only.

Sliding-window layers (``use_sliding_window`` + ``max_window_layers``, read through HF's
``layer_types``) map to megatron-core's per-layer ``window_attn_skip_freq`` list.
"""

from __future__ import annotations

from toolkit.adapters import Family, register


@register
class Qwen2(Family):
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    qkv_bias = True
    linear_bias = mlp_bias = False
