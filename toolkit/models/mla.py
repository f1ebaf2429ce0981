"""Multi-latent attention (DeepSeek-V3, Kimi K2) at tp > 1 without Transformer Engine.

megatron-core 0.16.1's local spec builds MLA's ``linear_kv_down_proj`` as a column-parallel
layer: each tp rank computes its columns of ``[kv_latent; k_rope]`` and MLA gathers them. The
shared RoPE key ``k_rope`` is then used by every rank's own heads, but the gather's backward only
keeps each rank's columns of the gradient: the RoPE columns get the gradient of one rank's heads,
never the sum over tp. Layer 1's weights still train right, while the gradient flowing into the
layer (its input norm, the layers below, the embedding) is wrong (measured: 8e-2 relative at
tp2 + SP; the losses part from step 2 on).

Transformer Engine's spec avoids it with a duplicated down projection whose RoPE part is gathered
over the sequence-parallel region (backward: reduce-scatter, the sum over tp). ``MlaSelfAttention``
gives the local spec the same shape of output: the column-parallel output is gathered whole (and
scattered back to the rank's sequence part under SP), so MLA takes its duplicated-layer path.
Training at tp > 1 always has SP (these models are MoE); without it (generation) the RoPE part's
gradient would be summed over tp explicitly. The weight stays split by columns (checkpoints and
mappings unchanged); at tp = 1 nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


def _whole_latent(module: torch.nn.Module, _inputs: Any, output: tuple) -> tuple:
    """Forward hook of ``linear_kv_down_proj``: its output as a duplicated layer's."""
    out, bias = output
    config, group = module.config, module.tp_group
    whole = gather_from_tensor_model_parallel_region(out, group=group)
    if config.sequence_parallel:  # MLA gathers k_rope over the sequence: backward sums over tp
        return scatter_to_sequence_parallel_region(whole, group=group), bias
    latent, rope = whole.split([config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
    return torch.cat([latent, copy_to_tensor_model_parallel_region(rope, group=group)], -1), bias


class MlaSelfAttention(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` with the RoPE key's gradient summed over tp."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.linear_kv_down_proj.register_forward_hook(_whole_latent)
