"""FP8 checkpoints (DeepSeek-V3's published layout), dequantized on read, slice by slice.

Layout: a quantized linear weight ``X.weight`` is stored as ``float8_e4m3fn`` next to
``X.weight_scale_inv`` (float32, one scale per ``weight_block_size`` block, shape
``ceil(rows / br) x ceil(cols / bc)``); the weight is ``fp8.float() * scale_inv`` broadcast over
its blocks (as DeepSeek's ``weight_dequant`` computes it). ``config.json`` says so:
``quantization_config = {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128],
activation_scheme: dynamic}``. Other quantization configs are refused with a message.

``DequantizingReader`` wraps a slice reader (``HFReader``): scale tensors disappear from
``names``, a quantized weight reports the output dtype and ``read(name, region)`` reads only
the fp8 rows/columns of the region and the scales of the blocks it touches, then multiplies in
float32 one block row at a time and casts to the output dtype. The output dtype is the
checkpoint's own (``config.json`` ``dtype`` / ``torch_dtype``, bf16 for DeepSeek-V3) unless
the caller asks for another (``dequantize_to``: the converter's ``--dtype``), so the float32
product is rounded once, into the dtype written. Byte-copy fast paths never apply to a
quantized weight: this reader offers no file segments for it.
"""

from __future__ import annotations

import math
from typing import Any

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.source import TensorSource
from toolkit.checkpoint.torchfree import dtypes
from toolkit.checkpoint.wrapped import WrappedReader
from toolkit.lazy import torch

SCALE = "_scale_inv"  # suffix of a weight's scale tensor: X.weight -> X.weight_scale_inv
FP8 = dtypes.FLOAT8_E4M3


def block_size(config: dict) -> tuple[int, int] | None:
    """The ``[rows, cols]`` scale block of an FP8 ``config.json`` (``None``: not quantized);
    raises CheckpointError for a quantization this reader cannot dequantize exactly."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"quantization_config.quant_method={method!r} is not supported: mdtk reads fp8 "
            "checkpoints with block scales (DeepSeek-V3's layout) and mxfp4 experts (GPT-OSS's) "
            "only. Dequantize the checkpoint with its own tools first.")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"quantization_config.fmt={fmt!r}: only e4m3 (float8_e4m3fn) "
                              "weights are supported.")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"quantization_config.activation_scheme={q.get('activation_scheme')!r}: static "
            "activation scales (input_scale tensors) are not supported; only 'dynamic'.")
    block = q.get("weight_block_size")
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"quantization_config.weight_block_size={block!r}: expected two positive integers "
            "such as [128, 128] (per-tensor or per-channel fp8 scales are not supported).")
    return int(block[0]), int(block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """float32 ``weight.float() * scale_inv`` broadcast over blocks. ``weight`` is a region
    starting at element ``offset`` of the full tensor; ``scale_inv`` holds the scales of the
    blocks it touches (from block ``offset // block``)."""
    (r0, c0), (br, bc) = offset, block
    rows = torch.arange(r0, r0 + weight.shape[0]) // br - r0 // br
    cols = torch.arange(c0, c0 + weight.shape[1]) // bc - c0 // bc
    return weight.float() * scale_inv.float()[rows][:, cols]


class DequantizingReader(WrappedReader):
    """A slice reader whose fp8 weights come out dequantized (see the module docstring)."""

    def __init__(self, inner: TensorSource, block: tuple[int, int], out_dtype: torch.dtype):
        self.inner, self.block, self.out_dtype = inner, block, out_dtype
        self.path = getattr(inner, "path", None)
        names = set(inner.names)
        self.quantized: set[str] = set()
        for name in inner.names:
            if inner.dtype(name) == FP8:
                self._check(name, names)
                self.quantized.add(name)
            elif inner.dtype(name).is_floating_point and inner.dtype(name).itemsize == 1:
                raise CheckpointError(f"{self.path}: {name} is {inner.dtype(name)}; only "
                                      "float8_e4m3fn weights are supported.")
        scales = {n + SCALE for n in self.quantized}
        orphans = sorted(n for n in names if n.endswith(SCALE) and n not in scales)
        if orphans:
            raise CheckpointError(f"{self.path}: scale tensors without an fp8 weight: "
                                  f"{', '.join(orphans[:4])}.")
        self._names = [n for n in inner.names if n not in scales]

    def _check(self, name: str, names: set[str]) -> None:
        shape = tuple(self.inner.shape(name))
        if name + SCALE not in names:
            raise CheckpointError(f"{self.path}: fp8 tensor {name} has no {name + SCALE}.")
        want = tuple(math.ceil(n / b) for n, b in zip(shape, self.block, strict=False))
        got = tuple(self.inner.shape(name + SCALE))
        if len(shape) != 2 or got != want:
            raise CheckpointError(
                f"{self.path}: {name + SCALE} has shape {got}; {name} {shape} with "
                f"{self.block[0]}x{self.block[1]} blocks needs {want}.")

    def dequantize_to(self, dtype: torch.dtype) -> None:
        """Produce dequantized weights in ``dtype`` (the converter's ``--dtype``)."""
        self.out_dtype = dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.inner.shape(name))

    def dtype(self, name: str) -> torch.dtype:
        return self.out_dtype if name in self.quantized else self.inner.dtype(name)

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype on disk (float8_e4m3fn for a quantized weight): ``mdtk inspect`` shows it."""
        return self.inner.dtype(name)

    def locate(self, name: str) -> Any:
        return self.inner.locate(name)

    def byte_range(self, name: str, region: tuple[tuple[int, int], ...]) -> Any:
        """Where a region lies as stored, for the file-to-file copy path: never for a quantized
        weight (its bytes are not the output's), else what the inner reader says (the bf16
        embeddings, output layer and norms of an FP8 checkpoint copy as ``cp`` does)."""
        inner = getattr(self.inner, "byte_range", None)
        if name in self.quantized or inner is None:
            return None
        return inner(name, region)

    def read(self, name: str, region: tuple[tuple[int, int], ...]) -> torch.Tensor:
        if name not in self.quantized:
            return self.inner.read(name, region)
        (r0, r1), (c0, c1) = region
        br, bc = self.block
        out = torch.empty((r1 - r0, c1 - c0), dtype=dtypes.to_torch(self.out_dtype))
        scale_cols = (c0 // bc, -(-c1 // bc))
        a = r0
        while a < r1:  # one block row at a time: memory holds the output plus one block row
            b = min(r1, (a // br + 1) * br)
            w = self.inner.read(name, ((a, b), (c0, c1)))
            s = self.inner.read(name + SCALE, ((a // br, a // br + 1), scale_cols))
            out[a - r0:b - r0] = dequantize(w, s, self.block, (a, c0))
            a = b
        return out



def dequantizing(reader: TensorSource, config: dict, out_dtype: torch.dtype | None = None
                 ) -> TensorSource:
    """``reader`` itself for an unquantized checkpoint, else a ``DequantizingReader`` over it
    producing ``out_dtype`` (default: the checkpoint's dtype from ``config``, else bf16)."""
    try:
        block = block_size(config)
    except CheckpointError as err:
        reader.close()
        raise CheckpointError(f"{getattr(reader, 'path', '')}: {err}") from err
    if block is None:
        return reader
    try:
        return DequantizingReader(reader, block, out_dtype or declared_output(config))
    except BaseException:
        reader.close()
        raise


def declared_output(config: Any) -> Any:
    """The dtype a quantized checkpoint's weights come out in by default: its declared
    ``dtype`` / ``torch_dtype`` when that is a 16- or 32-bit float type, else bf16."""
    declared = str(config.get("dtype") or config.get("torch_dtype"))
    return {"float32": dtypes.FLOAT32, "float16": dtypes.FLOAT16}.get(declared, dtypes.BFLOAT16)
