"""MXFP4 checkpoints (GPT-OSS's published layout), dequantized on read, one expert at a time.

Layout (OCP microscaling, as OpenAI publishes GPT-OSS and transformers reads it): a quantized
stacked expert weight ``X`` (``[experts, in, out]`` once dequantized) is stored as
``X_blocks`` (uint8 ``[experts, out, in / 32, 16]``: 32 FP4 E2M1 values per block, two per byte,
the low nibble first) and ``X_scales`` (uint8 ``[experts, out, in / 32]``: one power of two per
block, E8M0 with bias 127). The value of nibble ``n`` in a block with scale byte ``s`` is
``FP4[n] * 2 ** (s - 127)``, the same products transformers' ``convert_moe_packed_tensors``
computes (``ldexp`` of the table value), so the weights are exact in bf16 and float32.
``config.json`` says ``quantization_config = {quant_method: mxfp4, ...}``; the biases,
attention, router, embeddings and head are stored unquantized.

``Mxfp4Reader`` wraps a slice reader: ``X_blocks`` / ``X_scales`` disappear from ``names``,
``X`` takes their place in the output dtype (the checkpoint's dtype, bf16 for GPT-OSS, unless
the caller asks for another: ``dequantize_to``, the converter's ``--dtype``). Reading a region
reads only the blocks of the experts and rows it covers.
"""

from __future__ import annotations

from typing import Any

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.fp8 import declared_output
from toolkit.checkpoint.source import TensorSource
from toolkit.checkpoint.torchfree import dtypes
from toolkit.checkpoint.wrapped import WrappedReader
from toolkit.lazy import torch

METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32  # values per scale
#: FP4 E2M1 by nibble (sign bit 3): the OCP table, as transformers' ``FP4_VALUES``.
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: Any) -> torch.Tensor:
    """``[..., out, in / 32, 16]`` packed nibbles and ``[..., out, in / 32]`` scale bytes ->
    ``[..., in, out]`` values in ``dtype``."""
    table = torch.tensor(FP4, dtype=dtype)
    lo, hi = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., out, in / 32, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1)).to(dtype)
    return values.flatten(-2).transpose(-1, -2)


def quantized_names(names: list[str]) -> list[str]:
    """The dequantized names ``X`` of the ``X_blocks`` / ``X_scales`` pairs among ``names``."""
    present = set(names)
    return [n[:-len(BLOCKS)] for n in names
            if n.endswith(BLOCKS) and n[:-len(BLOCKS)] + SCALES in present]


class Mxfp4Reader(WrappedReader):
    """A slice reader whose MXFP4 weights come out dequantized (see the module docstring)."""

    def __init__(self, inner: TensorSource, out_dtype: Any):
        self.inner, self.out_dtype = inner, out_dtype
        self.path = getattr(inner, "path", None)
        names = list(inner.names)
        self.quantized = set(quantized_names(names))
        for x in sorted(self.quantized):
            self._check(x)
        packed = {x + s for x in self.quantized for s in (BLOCKS, SCALES)}
        orphans = sorted(n for n in names if n.endswith((BLOCKS, SCALES)) and n not in packed)
        if orphans:
            raise CheckpointError(f"{self.path}: MXFP4 tensors without their pair: "
                                  f"{', '.join(orphans[:4])}.")
        self._names = [n[:-len(BLOCKS)] if n in packed and n.endswith(BLOCKS) else n
                       for n in names if n not in packed or n.endswith(BLOCKS)]

    def _check(self, x: str) -> None:
        b, s = tuple(self.inner.shape(x + BLOCKS)), tuple(self.inner.shape(x + SCALES))
        if (len(b) < 3 or b[-1] != BLOCK // 2 or b[:-1] != s
                or self.inner.dtype(x + BLOCKS) != dtypes.UINT8
                or self.inner.dtype(x + SCALES) != dtypes.UINT8):
            raise CheckpointError(f"{self.path}: {x}{BLOCKS} {b} / {x}{SCALES} {s} are not MXFP4 "
                                  f"pairs (uint8 [..., out, in / 32, 16] and [..., out, in / 32]).")

    def dequantize_to(self, dtype: Any) -> None:
        """Produce dequantized weights in ``dtype`` (the converter's ``--dtype``)."""
        self.out_dtype = dtype

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.quantized:
            return tuple(self.inner.shape(name))
        *lead, out, groups, _ = self.inner.shape(name + BLOCKS)
        return (*lead, groups * BLOCK, out)

    def dtype(self, name: str) -> Any:
        return self.out_dtype if name in self.quantized else self.inner.dtype(name)

    def stored_dtype(self, name: str) -> Any:
        """The dtype on disk (uint8 blocks for a quantized weight): ``mdtk inspect`` shows it."""
        return dtypes.UINT8 if name in self.quantized else self.inner.dtype(name)

    def locate(self, name: str) -> Any:
        return self.inner.locate(name + BLOCKS if name in self.quantized else name)

    def byte_range(self, name: str, region: Any) -> Any:
        inner = getattr(self.inner, "byte_range", None)
        return None if name in self.quantized or inner is None else inner(name, region)

    def read(self, name: str, region: tuple[tuple[int, int], ...]) -> torch.Tensor:
        if name not in self.quantized:
            return self.inner.read(name, region)
        *lead, (i0, i1), (o0, o1) = region
        groups = (i0 // BLOCK, -(-i1 // BLOCK))
        blocks = self.inner.read(name + BLOCKS, (*lead, (o0, o1), groups, (0, BLOCK // 2)))
        scales = self.inner.read(name + SCALES, (*lead, (o0, o1), groups))
        out = dequantize(blocks, scales, dtypes.to_torch(self.out_dtype))
        start = groups[0] * BLOCK
        return out[..., i0 - start:i1 - start, :].contiguous()



def dequantizing(reader: TensorSource, config: Any, out_dtype: Any = None) -> TensorSource:
    """An ``Mxfp4Reader`` over ``reader`` producing ``out_dtype`` (default: the checkpoint's
    dtype from ``config``, else bf16); ``reader`` itself when it holds no MXFP4 pair."""
    if not quantized_names(list(reader.names)):
        return reader
    try:
        return Mxfp4Reader(reader, out_dtype or declared_output(config))
    except BaseException:
        reader.close()
        raise

