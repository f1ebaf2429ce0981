"""Layer pieces megatron-core's local spec lacks for Gemma 3 (``toolkit.models.layer_spec`` and
``build_chunks`` put them in when a family asks), each usable on its own.

- ``ZeroCenteredRMSNorm``: Gemma's RMSNorm, ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` computed
  in float32 and cast back, exactly as transformers' ``Gemma3RMSNorm``. The parameter is the
  stored ``w`` itself, so checkpoints round-trip bit-exactly; converting to ``1 + w`` in the
  mapping instead would round in bf16 and lose the stored value.
- ``RowParallelLinearNorm``: a row-parallel linear followed by a norm over its (reduced) output:
  Gemma's ``post_attention_layernorm`` after ``o_proj`` and ``post_feedforward_layernorm`` after
  ``down_proj`` (as NeMo's ``TERowParallelLinearLayerNorm``). Under sequence parallelism the
  output is split by sequence, the norm works per token, and its weight is marked
  ``sequence_parallel`` so its grads are summed over the TP group.
- ``LocalRopeSelfAttention``: self-attention whose sliding-window layers use their own RoPE base
  (``rope_local_base_freq``) instead of the model's (global layers keep the model's RoPE,
  scaling included).
- ``scale_embeddings``: the word embedding output times ``sqrt(hidden)``, the scale rounded to
  the embedding's dtype first, as transformers' ``Gemma3TextScaledWordEmbedding``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from toolkit.models.gpt import per_token_rope
from toolkit.models.packed import Segments


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred gamma: scales by ``1 + weight`` (float32 math)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6,
                 **_: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class RowParallelLinearNorm(RowParallelLinear):
    """Row-parallel linear, then ``ZeroCenteredRMSNorm`` over its output (``post_layernorm``)."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 **kwargs: Any):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = ZeroCenteredRMSNorm(config, output_size, config.layernorm_epsilon)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, bias = super().forward(input_)
        if bias is not None:
            out = out + bias
        return self.post_layernorm(out), None


class LocalRopeSelfAttention(SelfAttention):
    """Self-attention; a sliding-window layer rotates q/k with base ``local_rotary_base``."""

    def __init__(self, *args: Any, local_rotary_base: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.local_rope = None
        if is_layer_window_attention(cfg.window_size, cfg.window_attn_skip_freq,
                                     self.layer_number):
            self.local_rope = RotaryEmbedding(
                kv_channels=cfg.kv_channels, rotary_percent=1.0,
                rotary_interleaved=cfg.rotary_interleaved, rotary_base=local_rotary_base,
                use_cpu_initialization=cfg.use_cpu_initialization, cp_group=self.pg_collection.cp)

    def forward(self, hidden_states: torch.Tensor, *args: Any, rotary_pos_emb: Any = None,
                **kwargs: Any) -> Any:
        if self.local_rope is not None and rotary_pos_emb is not None:
            if isinstance(rotary_pos_emb, tuple):
                raise ValueError("LocalRopeSelfAttention: separate q/k rotary embeddings are not "
                                 "supported.")
            segments = kwargs.get("packed_seq_params")
            if isinstance(segments, Segments):  # packed examples: positions restart per example
                rotary_pos_emb = per_token_rope(self.local_rope, segments)
            else:
                cp = self.pg_collection.cp.size() if self.pg_collection.cp is not None else 1
                rotary_pos_emb = self.local_rope(rotary_pos_emb.shape[0] * cp)
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def scale_embeddings(chunk: torch.nn.Module, scale: float) -> None:
    """Multiply ``chunk.embedding``'s output by ``scale`` in the embedding's dtype (a forward
    hook: no parameter, so checkpoints are unchanged)."""
    embedding = getattr(chunk, "embedding", None)
    if embedding is None:  # not the first pipeline stage
        return

    def hook(module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        dtype = module.word_embeddings.weight.dtype
        return output * torch.tensor(scale, dtype=torch.float32).to(dtype)

    embedding.register_forward_hook(hook)
