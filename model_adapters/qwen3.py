"""Qwen3 (``Qwen3ForCausalLM``): Llama with RMSNorm on q and k over ``head_dim`` (q/k norm).

``head_dim`` is explicit and may differ from hidden_size / num_attention_heads; it becomes
megatron-core's ``kv_channels``. The norms are applied before RoPE in both implementations.
"""

from __future__ import annotations

from toolkit.adapters import Family, register


@register
class Qwen3(Family):
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    qk_norm = True
