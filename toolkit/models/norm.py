"""A LayerNorm/RMSNorm usable with sequence parallelism without apex or Transformer Engine.

megatron-core's torch fallback (``WrappedTorchNorm``) refuses sequence parallelism because with SP
each tensor-parallel rank normalises a different slice of the sequence, so the norm weights'
grads must be summed over the TP group. Marking the weights ``sequence_parallel=True`` is how
megatron-core (and ``toolkit.parallel.grads``) knows to do that.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class TorchNorm(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ):
        super().__init__()
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by mdtk's TorchNorm")
        kind = normalization or config.normalization
        self.kind = kind
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        elif kind == "RMSNorm":
            self.register_parameter("bias", None)
        else:
            raise ValueError(f"normalization={kind!r}: only LayerNorm and RMSNorm are supported")
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.weight.shape[0],)
        if self.kind == "LayerNorm":
            return torch.nn.functional.layer_norm(x, shape, self.weight, self.bias, self.eps)
        return torch.nn.functional.rms_norm(x, shape, self.weight, self.eps)
