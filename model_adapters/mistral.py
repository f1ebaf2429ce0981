"""Mistral (``MistralForCausalLM``): Llama with GQA and optional sliding-window attention.

``sliding_window`` (v0.1: 4096; null from v0.2) becomes megatron-core's ``window_size``
(``toolkit.adapters.hfconfig.window_kwargs``).
"""

from __future__ import annotations

from toolkit.adapters import Family, register


@register
class Mistral(Family):
    architectures = ("MistralForCausalLM",)
    model_types = ("mistral",)
