"""Mistral (``MistralForCausalLM``): Llama with GQA and optional sliding-window attention.

``sliding_window`` (v0.1: 4096; null from v0.2) becomes megatron-core's ``window_size``
(see ``model_adapters.llama.window_kwargs``).
"""

from __future__ import annotations

from model_adapters import register
from model_adapters.llama import Llama


@register
class Mistral(Llama):
    architectures = ("MistralForCausalLM",)
