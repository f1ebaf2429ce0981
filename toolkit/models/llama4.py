"""Llama 4's attention pieces for megatron-core's local layer spec (text model).

Llama 4 alternates RoPE layers, whose attention is *chunked* (a query sees the keys of its own
``attention_chunk_size`` block only, causally), with NoPE layers (no rotary embedding:
megatron-core's ``no_rope_freq``) that attend to the whole prefix. RoPE layers L2-normalise q
and k per head *after* the rotation (``use_qk_norm``, no weight); NoPE layers scale the queries
by ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))`` (``attn_temperature_tuning``).
All three happen between the rotation and the softmax, so they live in the core attention:
``llama4_attention(base)`` wraps mdtk's core attention (local or SDPA, ``toolkit.models
.attention``).

Chunked attention is computed as packed attention (``toolkit.models.packed.attend``) over
pieces that restart at every chunk (and at every example of a packed row, chunks counted from
the example's start): no s x s mask, the same kernels as packing, on CPU and GPU.
Positions for the temperature are the row's (0..s-1), or each example's own position ids when
rows are packed, so a packed example is computed as it is alone. Context parallelism is refused
(the family's ``refuses_cp``, checked by ``Adapter.validate``).
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.models.packed import Segments, attend


def _l2(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Llama4TextL2Norm``: x / sqrt(mean(x^2) + eps), in float32."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def chunk_segments(segments: Segments | None, seq_len: int, batch: int, chunk: int,
                   position_ids: torch.Tensor | None) -> Segments:
    """Pieces of every row restarting at each chunk of ``chunk`` tokens of each example."""
    rows = []
    for i in range(batch):
        spans = segments.examples(i) if segments is not None else [(0, seq_len)]
        rows.append(tuple(s for a, e in spans for s in range(a, e, chunk)))
    return Segments(qkv_format="sbhd", starts=tuple(rows), seq_len=seq_len,
                    max_seqlen_q=seq_len, max_seqlen_kv=seq_len, position_ids=position_ids)


def llama4_attention(base: type) -> type:
    """``base`` (a core attention class) with Llama 4's per-layer behaviour."""

    def __init__(self, *args: Any, chunk: int | None = None, chunked: tuple[int, ...] = (),
                 l2_norm: tuple[int, ...] = (), temperature: tuple[float, float] | None = None,
                 tuned: tuple[int, ...] = (), **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        layer = self.layer_number - 1
        self.chunk = chunk if layer in chunked else None
        self.l2_eps = self.config.layernorm_epsilon if layer in l2_norm else None
        self.temperature = temperature if layer in tuned else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        segments = packed_seq_params if isinstance(packed_seq_params, Segments) else None
        if self.l2_eps is not None:
            query, key = _l2(query, self.l2_eps), _l2(key, self.l2_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            s, b = query.shape[:2]
            pos = (segments.position_ids.t() if segments is not None
                   else torch.arange(s, device=query.device).unsqueeze(1).expand(s, b))
            scale = torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            query = (query * scale[:, :, None, None]).to(query.dtype)
        if self.chunk is not None:
            if attention_bias is not None:
                raise ValueError("Llama 4 chunked attention with an attention bias.")
            pieces = chunk_segments(segments, query.shape[0], query.shape[1], self.chunk,
                                    None if segments is None else segments.position_ids)
            return attend(self, query, key, value, pieces)
        return base.forward(self, query, key, value, attention_mask, attn_mask_type,
                            attention_bias, packed_seq_params)

    return type(f"Llama4{base.__name__}", (base,), {
        "__init__": __init__, "forward": forward, "__doc__": __doc__})
