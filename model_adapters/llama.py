"""Llama 2 / 3 / 3.1 / 3.2 (``LlamaForCausalLM``): every default of ``toolkit.adapters.Family``.

Pre-norm RMSNorm decoder, GQA attention with rotate-half RoPE (megatron-core's default,
non-interleaved; llama3 and linear scaling translated by ``toolkit.adapters.hfconfig``), SwiGLU
MLP. ``attention_bias`` (q/k/v and o_proj) and ``mlp_bias`` must be equal: megatron-core has one
switch for the o_proj and MLP biases.
"""

from __future__ import annotations

from toolkit.adapters import Family, register


@register
class Llama(Family):
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
