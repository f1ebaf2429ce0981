"""Packed sequences: several examples share one row, and each attends only to itself.

A micro-batch says where its examples start by its position ids: they restart at 0 at every
example (SFT rows packed by ``data.pack``, documents cut at EOD with ``data.reset_at_eod``).
``segments_of`` turns them into :class:`Segments`, megatron-core's ``PackedSeqParams`` with
``qkv_format='sbhd'``: megatron-core hands it untouched from ``GPTModel.forward`` to the core
attention of every layer (also under recompute) and only reinterprets the ``thd`` format, so the
boundaries need no ``[b, s, s]`` mask and reach every pipeline and virtual stage that is given
the micro-batch's position ids (the engine gives them to all). Rows that are one example each
give ``None``: the unpacked path, unchanged.

Attention per example (``attend``; the kernel is chosen per call and named by ``kernel_name``):

- ``flash-attn varlen``: ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16) when the
  ``flash-attn`` package is installed: one call over the whole micro-batch.
- ``torch varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, no attention
  dropout, no sliding window): the same flash kernel, shipped with torch.
- ``sdpa per example``: ``scaled_dot_product_attention(is_causal=True)`` on each example
  (cuDNN / flash on CUDA, the CPU flash kernel on CPU): work and memory follow the examples'
  lengths, no mask at all (a sliding-window layer builds its band mask per example).

An explicit block-diagonal boolean mask is never used: it is ``s x s`` per row and forces SDPA
onto its memory-efficient or math kernels (see docs/benchmarks.md "GPU check"). Transformer
Engine's THD path is not used because mdtk builds megatron-core's local layer spec on every
machine (TE is in neither image). Context parallelism cuts each query chunk at the example
boundaries (``Segments.pieces``; ``cp_attention``). What no kernel here computes is refused
before the model is built (``check_packing``): multi-latent attention (megatron-core reads
packed MLA input only as THD for TE), learnable softmax offsets, other attention biases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.utils import is_layer_window_attention

from toolkit.parallel.layout import LayoutError

KERNELS = ("flash-attn varlen", "torch varlen", "sdpa per example")


class PackingUnsupported(LayoutError):
    """A model feature that packed examples cannot be kept apart in."""


@dataclass
class Segments(PackedSeqParams):
    """Where the examples of each row start. ``starts[i]``: the first position of every example
    of row ``i`` in full-sequence coordinates (0 first; before any context-parallel split);
    ``position_ids``: this rank's position ids [b, s_local] on the device (set by the engine
    after the CP split); ``seq_len``: the full row length."""

    starts: tuple[tuple[int, ...], ...] = ()
    seq_len: int = 0
    position_ids: torch.Tensor | None = None
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def examples(self, row: int) -> list[tuple[int, int]]:
        """(start, end) of each example of ``row``."""
        s = self.starts[row]
        return list(zip(s, (*s[1:], self.seq_len), strict=True))

    def pieces(self, row: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(q0, q1, k0) for each example overlapping the query range [lo, hi): queries
        [q0, q1) attend keys [k0, q1) causally (bottom-right aligned); in order, covering it."""
        return [(max(a, lo), min(e, hi), a) for a, e in self.examples(row) if a < hi and e > lo]

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """Cumulative example lengths over the flattened rows (int32 on ``device``) and the
        longest example, for the varlen kernels; computed once per micro-batch."""
        if "cu" not in self.cache:
            bounds = [i * self.seq_len + a for i, row in enumerate(self.starts) for a in row]
            bounds.append(len(self.starts) * self.seq_len)
            longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
            self.cache["cu"] = (torch.tensor(bounds, dtype=torch.int32, device=device), longest)
        return self.cache["cu"]


def segments_of(position_ids: torch.Tensor) -> Segments | None:
    """The :class:`Segments` of full-length position ids [b, s] (on the CPU: read once per
    micro-batch), or None when every row is one example (positions 0..s-1)."""
    pos = position_ids.cpu()
    restarts = pos[:, 1:] == 0
    if not bool(restarts.any()):
        return None
    if bool((pos[:, 0] != 0).any()):
        raise ValueError("packed position ids must start every row at 0.")
    starts = tuple((0, *(torch.nonzero(r).flatten() + 1).tolist()) for r in restarts)
    s = pos.shape[1]
    return Segments(qkv_format="sbhd", starts=starts, seq_len=s, max_seqlen_q=s,
                    max_seqlen_kv=s)


def localise(segments: Segments | None, position_ids: torch.Tensor) -> Segments | None:
    """``segments`` carrying this rank's (device, CP-cut) position ids."""
    if segments is None:
        return None
    return dataclasses.replace(segments, position_ids=position_ids, cache={})


def check_packing(config) -> None:
    """Refuse, before the model is built, a model whose attention packed examples cannot be
    kept apart in (every message names the feature and the fix)."""
    fix = "set data.pack=false (and data.reset_at_eod=false) for this model"
    if getattr(config, "multi_latent_attention", False):
        raise PackingUnsupported("packed sequences with multi-latent attention (DeepSeek) are not "
                                 "supported: megatron-core reads packed MLA input only in TE's THD "
                                 f"layout; {fix}.")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise PackingUnsupported(f"packed sequences with softmax_type={config.softmax_type} "
                                 f"(learnable softmax offsets) are not supported; {fix}.")
    if getattr(config, "position_embedding_type", "rope") not in ("rope", "yarn",
                                                                  "learned_absolute", "none"):
        raise PackingUnsupported(f"packed sequences with position_embedding_type="
                                 f"{config.position_embedding_type} are not supported; {fix}.")


# -- kernels -------------------------------------------------------------------------------

@functools.cache
def _flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def kernel_name(dtype: torch.dtype, device: torch.device, *, dropout: float = 0.0,
                window: bool = False) -> str:
    """The kernel ``attend`` uses for these inputs (one of ``KERNELS``)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type == "cuda" and half:
        if _flash_attn() is not None:
            return KERNELS[0]
        if _torch_varlen() is not None and dropout == 0.0 and not window:
            return KERNELS[1]
    return KERNELS[2]


def describe(config, device: torch.device) -> str:
    """One line for the run's log: which kernel keeps packed examples apart."""
    name = kernel_name(config.params_dtype, device, dropout=config.attention_dropout)
    where = "CPU flash kernel" if device.type == "cpu" else "SDPA's pick"
    detail = {KERNELS[0]: "one call per layer", KERNELS[1]: "one call per layer",
              KERNELS[2]: f"one call per example, {where}"}[name]
    return f"packed examples kept apart by {name} ({detail})"


def attend(module, query, key, value, segments: Segments) -> torch.Tensor:
    """Core attention of packed rows for a megatron-core attention ``module`` (its heads per
    partition, softmax scale, dropout, layer number): [s, b, heads, d] -> [s, b, heads * d]."""
    cfg = module.config
    window = cfg.window_size if is_layer_window_attention(
        cfg.window_size, cfg.window_attn_skip_freq, module.layer_number) else None
    dropout = module.attention_dropout.p if module.training else 0.0
    name = kernel_name(query.dtype, query.device, dropout=dropout, window=window is not None)
    rng = (tensor_parallel.get_cuda_rng_tracker().fork()
           if dropout > 0 and not cfg.sequence_parallel else contextlib.nullcontext())
    with rng:
        if name == KERNELS[2]:
            out = _per_example(query, key, value, segments, module.softmax_scale, dropout, window)
        else:
            out = _varlen(name, query, key, value, segments, module.softmax_scale, dropout, window)
    return out.reshape(*out.shape[:2], module.hidden_size_per_partition)


def _per_example(query, key, value, segments: Segments, scale: float, dropout: float,
                 window) -> torch.Tensor:
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for i in range(q.shape[0]):
        parts = []
        for a, e in segments.examples(i):
            qs, ks, vs = (t[i:i + 1, :, a:e] for t in (q, k, v))
            mask = None if window is None else _band(e - a, window, q.device)
            parts.append(F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                scale=scale, enable_gqa=gqa))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).permute(2, 0, 1, 3)  # [s, b, heads, d]


def _band(n: int, window, device) -> torch.Tensor:
    """megatron-core's sliding window over one example: key j is seen by query i when
    i - window[0] <= j <= i + window[1] (True = attend)."""
    ones = torch.ones(n, n, dtype=torch.bool, device=device)
    return ones.tril(window[1]).triu(-window[0])


def _varlen(name: str, query, key, value, segments: Segments, scale: float, dropout: float,
            window) -> torch.Tensor:
    s, b = query.shape[:2]
    q, k, v = (t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value))
    cu, longest = segments.cu_seqlens(query.device)
    if name == KERNELS[0]:
        out = _flash_attn()(q, k, v, cu, cu, longest, longest, dropout_p=dropout,
                            softmax_scale=scale, causal=True,
                            window_size=(-1, -1) if window is None else tuple(window))
    else:
        varlen, params = _torch_varlen()
        kwargs = {}
        if "scale" in params:
            kwargs["scale"] = scale
        elif scale is not None:  # an older signature: the kernel's default 1/sqrt(d)
            q = q * (scale * q.shape[-1] ** 0.5)
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        else:  # torch <= 2.10 spelled causal attention as is_causal
            kwargs["is_causal"] = True
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            else:
                reps = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
        out = varlen(q, k, v, cu, cu, longest, longest, **kwargs)
    return out.view(b, s, *out.shape[1:]).transpose(0, 1)
