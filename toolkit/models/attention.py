"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

megatron-core's local ``DotProductAttention`` materialises the [b, heads, s, s] score matrix in
the activation dtype and keeps it for backward: at seq 2048 that is most of a layer's activation
memory and most of its attention time. Transformer Engine's fused attention is the usual cure,
but it needs CUDA and a matching build. SDPA is in every torch: on CUDA it dispatches to the
flash / memory-efficient kernels (no s x s tensor), on CPU to the math kernel (same numbers as the
local path). This class keeps megatron-core's constructor (head counts per TP partition, softmax
scale incl. query-key layer scaling, dropout) and only replaces ``forward``; anything SDPA cannot
express (learnable softmax offsets, sliding windows, attention bias) goes back to megatron-core's
own forward, so choosing SDPA never changes what is computed. Packed micro-batches (examples kept
apart, ``toolkit.models.packed``) are computed per example by both classes (``LocalAttention`` is
megatron-core's local attention plus that).

Selected by ``toolkit.models.layer_spec(attention=...)``: ``auto`` (SDPA on CUDA, local on CPU,
where the local path is the historical reference of the parity tests), ``sdpa`` or ``local``;
``MDTK_ATTENTION`` overrides ``auto``.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from toolkit.models.packed import PackingUnsupported, Segments, attend

CHOICES = ("auto", "sdpa", "local")


class LocalAttention(DotProductAttention):
    """megatron-core's local core attention; a packed micro-batch (``packed.Segments``) is
    computed per example by ``packed.attend`` (megatron-core's own forward refuses it)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if isinstance(packed_seq_params, Segments):
            if attention_bias is not None:
                raise PackingUnsupported("packed sequences with an attention bias are not "
                                         "supported; set data.pack=false.")
            return attend(self, query, key, value, packed_seq_params)
        return super().forward(query, key, value, attention_mask, attn_mask_type,
                               attention_bias, packed_seq_params)


class SDPAttention(LocalAttention):
    """megatron-core core attention computed by SDPA (flash kernels on GPU)."""

    def _sdpa_can_run(self, attention_bias, packed_seq_params) -> bool:
        cfg = self.config
        return (attention_bias is None and packed_seq_params is None
                and getattr(cfg, "softmax_type", "vanilla") == "vanilla"
                and getattr(cfg, "window_size", None) is None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if not self._sdpa_can_run(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # [s, b, ng, hn] -> [s, b, np, hn], as megatron-core does
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [s, b, np, hn] -> [b, np, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        # megatron-core's masks are True where attention is NOT allowed; SDPA's the reverse.
        mask = None if attention_mask is None else ~attention_mask.bool()
        if mask is None and mask_type == AttnMaskType.causal and q.shape[2] != k.shape[2]:
            raise ValueError("SDPAttention: causal attention with sq != sk needs an explicit mask.")
        dropout = self.attention_dropout.p if self.training else 0.0
        # dropout draws from the TP-distinct RNG stream, as megatron-core's forward does
        rng = (tensor_parallel.get_cuda_rng_tracker().fork()
               if dropout > 0 and not self.config.sequence_parallel else contextlib.nullcontext())
        with rng:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                     dropout_p=dropout, scale=self.softmax_scale)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)


def resolve(choice: str | None = None) -> str:
    """``sdpa`` or ``local`` for ``choice`` (``auto``: SDPA on CUDA; ``MDTK_ATTENTION`` wins)."""
    from toolkit import runtime

    choice = choice or "auto"
    if choice == "auto":
        choice = os.environ.get("MDTK_ATTENTION", "auto")
    if choice not in CHOICES:
        raise ValueError(f"attention={choice!r}: choose one of {', '.join(CHOICES)}.")
    if choice == "auto":
        return "sdpa" if runtime.use_cuda() else "local"
    return choice


def core_attention(choice: str | None = None, *, latent: bool = False) -> type[torch.nn.Module]:
    """The core attention class; ``latent``: for megatron-core's multi-latent attention."""
    cls = SDPAttention if resolve(choice) == "sdpa" else LocalAttention
    return (_LATENT[cls] if latent else cls)


def latent_variant(cls: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """``cls`` accepting MLA's ``k_channels`` / ``v_channels`` (TE's attention takes them).

    The forwards read the head sizes from the q/k/v tensors; the output size comes from
    ``kv_channels``, which the MLA config sets to ``v_head_dim``; the softmax scale is passed.
    """
    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs) -> None:
        if v_channels is not None and v_channels != kwargs["config"].kv_channels:
            raise ValueError(f"MLA v_head_dim={v_channels} must equal kv_channels="
                             f"{kwargs['config'].kv_channels} for megatron-core's core attention.")
        cls.__init__(self, *args, **kwargs)

    return type(f"Latent{cls.__name__}", (cls,),
                {"__init__": __init__, "__doc__": latent_variant.__doc__})


_LATENT = {c: latent_variant(c) for c in (SDPAttention, LocalAttention)}
