"""Qwen3-Next's linear attention (gated DeltaNet) as a megatron-core layer piece, CPU included.

megatron-core 0.16.1 has a ``GatedDeltaNet`` (``ssm/gated_delta_net.py``), but it refuses to be
built without the ``fla`` package (Triton kernels, CUDA only), and it lays its fused input
projection out per TP rank as ``[q; k; v; z; beta; alpha]``, so a TP shard is not a contiguous
block of the tp=1 tensor (its checkpoints split the tensor into six sharded keys). This module
computes the same layer on any device:

- parameters named as megatron-core's (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``,
  ``out_norm``, ``out_proj``), but ``in_proj`` and ``conv1d`` are laid out per key-head group
  (``[q_g; k_g; v_g; z_g; beta_g; alpha_g]`` and ``[q_g; k_g; v_g]``, as megatron-core's own
  ``linear_qkv`` groups q/k/v): TP gives each rank whole groups, every TP shard is a contiguous
  block, and checkpoints (torch_dist, legacy) reshard with the plain rules;
- the causal depthwise convolution and the chunked gated delta rule in torch (``delta_rule``:
  the same algorithm and order of operations as transformers' ``torch_chunk_gated_delta_rule``,
  so fp32 logits equal its reference), or the CUDA kernels of ``causal-conv1d`` / ``fla`` when
  installed and the tensors are on a GPU (``MDTK_DELTA_KERNELS=torch`` forces the fallback);
- packed rows (``toolkit.models.packed.Segments``): the convolution and the recurrent state
  start from zero at every example, as Megatron-LM's THD path resets them (each example is
  computed alone);
- the output norm (over each value head, weight shared by all heads) sees only a rank's heads,
  so its gradient is summed over TP (``tp_partial_grad``, ``toolkit.parallel.grads``).

Context parallelism is refused before the model is built (``toolkit.models.build``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from toolkit.models.packed import Segments

CHUNK = 64  # transformers' (and fla's) chunk length of the chunked delta rule


@dataclass
class GatedDeltaNetSubmodules:
    in_proj: Any = None
    out_norm: Any = None
    out_proj: Any = None


def spec(norm: type) -> ModuleSpec:
    """The self-attention slot of a linear-attention layer (``norm``: the output norm)."""
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=tensor_parallel.ColumnParallelLinear, out_norm=norm,
        out_proj=tensor_parallel.RowParallelLinear))


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet layer: [s, b, h] -> ([s, b, h], None)."""

    def __init__(self, config: TransformerConfig, submodules: GatedDeltaNetSubmodules,
                 layer_number: int, pg_collection: Any = None, **_: Any):
        super().__init__(config)
        self.layer_number = layer_number
        tp = ps.get_tensor_model_parallel_world_size()
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.ratio = v_heads // k_heads
        self.groups = k_heads // tp  # key-head groups on this rank
        self.kernel = config.linear_conv_kernel_dim
        per_group = 2 * self.k_dim + 2 * self.ratio * (self.v_dim + 1)
        self.conv_per_group = 2 * self.k_dim + self.ratio * self.v_dim
        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, k_heads * per_group, config=config,
            init_method=config.init_method, gather_output=False, bias=False,
            skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1")
        channels = self.groups * self.conv_per_group
        self.conv1d = torch.nn.Conv1d(channels, channels, self.kernel, groups=channels,
                                      bias=False, padding=self.kernel - 1,
                                      dtype=config.params_dtype)
        local_v = self.groups * self.ratio
        self.dt_bias = torch.nn.Parameter(torch.ones(local_v, dtype=config.params_dtype))
        self.A_log = torch.nn.Parameter(torch.zeros(local_v, dtype=config.params_dtype))
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):
            tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.out_norm = build_module(submodules.out_norm, config=config,
                                     hidden_size=self.v_dim, eps=config.layernorm_epsilon)
        for p in self.out_norm.parameters():
            p.tp_partial_grad = tp > 1  # normalises this rank's value heads only
        self.out_proj = build_module(
            submodules.out_proj, v_heads * self.v_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2")

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None,
                packed_seq_params: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        proj, _ = self.in_proj(hidden_states)  # [s, b, groups * per_group] (whole sequence)
        s, b = proj.shape[:2]
        proj = proj.transpose(0, 1).reshape(b, s, self.groups, -1)
        dk, rv, r = self.k_dim, self.ratio * self.v_dim, self.ratio
        mixed, z, beta, alpha = torch.split(proj, [2 * dk + rv, rv, r, r], dim=-1)
        mixed = mixed.reshape(b, s, -1)
        beta = beta.reshape(b, s, -1).sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(alpha.reshape(b, s, -1).float()
                                                       + self.dt_bias)
        spans = (packed_seq_params.examples(i) if isinstance(packed_seq_params, Segments)
                 else [(0, s)] for i in range(b))
        rows = []
        for i, row in enumerate(spans):
            rows.append(torch.cat([self._mix(mixed[i:i + 1, a:e], decay[i:i + 1, a:e],
                                             beta[i:i + 1, a:e]) for a, e in row], dim=1))
        core = torch.cat(rows, dim=0)  # [b, s, local value heads, v_dim]
        gate = z.reshape(-1, self.v_dim)
        out = self.out_norm(core.reshape(-1, self.v_dim)) * F.silu(gate.float())
        out = out.to(hidden_states.dtype).reshape(b, s, -1).transpose(0, 1).contiguous()
        return self.out_proj(out)

    def _mix(self, mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor
             ) -> torch.Tensor:
        """One example: [1, n, channels] -> [1, n, value heads, v_dim] (state from zero)."""
        n = mixed.shape[1]
        x = causal_conv(mixed.transpose(1, 2), self.conv1d.weight, self.config.activation_func)
        x = x.transpose(1, 2).reshape(1, n, self.groups, self.conv_per_group)
        dk = self.k_dim
        q, k, v = torch.split(x, [dk, dk, self.ratio * self.v_dim], dim=-1)
        v = v.reshape(1, n, -1, self.v_dim)
        return delta_rule(q, k, v, decay, beta)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """TP-sharded along dim 0: ``conv1d.weight``, ``dt_bias``, ``A_log`` (whole groups, so
        the tp=1 tensor is the concatenation of the shards); the linears shard themselves."""
        own = {n: p for n, p in self.named_parameters(recurse=False)}
        own["conv1d.weight"] = self.conv1d.weight
        out = make_sharded_tensors_for_checkpoint(
            {k: v for k, v in own.items()}, prefix, dict.fromkeys(own, 0), sharded_offsets)
        for name in ("in_proj", "out_norm", "out_proj"):
            out.update(sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.",
                                                  sharded_offsets, metadata))
        return out


@functools.cache
def _cuda_kernels() -> tuple[Any, Any] | None:
    """``(causal_conv1d_fn, chunk_gated_delta_rule)`` when both packages are installed."""
    if os.environ.get("MDTK_DELTA_KERNELS", "auto") == "torch":
        return None
    try:
        from causal_conv1d import causal_conv1d_fn
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return causal_conv1d_fn, chunk_gated_delta_rule


def kernel_names(device: torch.device) -> str:
    """Which kernels compute the layer on ``device`` (for logs and the GPU check)."""
    return "causal-conv1d + fla" if device.type == "cuda" and _cuda_kernels() else "torch"


def causal_conv(x: torch.Tensor, weight: torch.Tensor, act: Any) -> torch.Tensor:
    """Depthwise causal convolution then the activation: x [b, channels, n], weight
    [channels, 1, kernel] (transformers' ``causal_conv1d_fn`` fallback)."""
    kernels = _cuda_kernels() if x.is_cuda else None
    if kernels is not None and act is F.silu:
        return kernels[0](x, weight.squeeze(1), None, activation="silu")
    n = x.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight, padding=weight.shape[-1] - 1,
                   groups=x.shape[1])[..., :n]
    return act(out).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
               beta: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule with q/k L2-normalised, from a zero state: q, k [b, n, key heads,
    dk], v [b, n, value heads, dv], decay (log space, <= 0) and beta [b, n, value heads];
    returns [b, n, value heads, dv] in v's dtype.

    The torch path is transformers' chunked algorithm: within each chunk the delta-rule
    updates are one unit-lower-triangular solve, and a scan over chunks carries the state."""
    kernels = _cuda_kernels() if q.is_cuda else None
    if kernels is not None:
        out, _ = kernels[1](q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
        return out
    dtype = v.dtype
    reps = v.shape[2] // k.shape[2]
    q, k = (t.repeat_interleave(reps, dim=2) for t in (q, k))
    q, k, v, beta, decay = (t.transpose(1, 2).to(torch.float32) for t in (q, k, v, beta, decay))
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    b, h, n, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, decay = (F.pad(t, (0, pad)) for t in (beta, decay))
    q, k, v = (t.reshape(b, h, -1, chunk, t.shape[-1]) for t in (q, k, v))
    kb, vb = k * beta.reshape(b, h, -1, chunk, 1), v * beta.reshape(b, h, -1, chunk, 1)
    cum = decay.reshape(b, h, -1, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (kb @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, kb * cum.exp().unsqueeze(-1), upper=False,
                                          unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    last = cum[..., -1].exp()[..., None, None]
    state = torch.zeros(b, h, dk, dv, dtype=torch.float32, device=q.device)
    outs = []
    for i in range(q.shape[2]):
        fresh = new_v[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ fresh)
        state = state * last[:, :, i] + k[:, :, i].transpose(-1, -2) @ fresh
    out = torch.stack(outs, dim=2).reshape(b, h, -1, dv)[:, :, :n]
    return out.transpose(1, 2).contiguous().to(dtype)
