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

transformers' own quantizer (``Mxfp4Config()`` on load, then ``save_pretrained``; 5.23 and 5.24)
writes the same names with the blocks along the *output* dimension: ``X_blocks`` ``[experts, in,
out / 32, 16]``. transformers cannot load such a file back (tests/data/gpt_oss_mxfp4_transformers
has one and says how it was made). The reader takes the orientation from the shape the model
needs (``expect``, called by ``stacked.StackedReader`` with the shape config.json gives): a
square weight, which fits both, follows the checkpoint's other weights (a file is written by one
quantizer); when none tells (hidden = 2 x intermediate), the published orientation is assumed.

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
#: the names transformers serializes its MXFP4 experts under (``Mxfp4HfQuantizer``), the only
#: ones ``dense_blocks`` renames
SAVED_DENSE = ("experts.gate_up_proj" + BLOCKS, "experts.down_proj" + BLOCKS)
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
        self.along_out: set[str] = set()  # blocks along the output dimension (``expect``)
        self._published: set[str] = set()
        self._square: set[str] = set()

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

    def expect(self, name: str, shape: tuple[int, ...]) -> None:
        """The model needs ``name`` as ``shape``: read its blocks in the orientation that gives
        it (see the module docstring). A shape neither gives is left to the caller to name."""
        if name not in self.quantized:
            return
        published, along_out = self._shapes(name)
        fits = (tuple(shape) == published, tuple(shape) == along_out)
        kind = {(True, True): self._square, (True, False): self._published,
                (False, True): self.along_out}.get(fits)
        if kind is not None:
            kind.add(name)
        if self._published and self.along_out:
            raise CheckpointError(
                f"{self.path}: MXFP4 blocks in two orientations: {min(self._published)}'s run "
                f"along the input dimension (GPT-OSS's published layout), "
                f"{min(self.along_out)}'s along the output dimension (transformers' on-the-fly "
                "quantizer's). One file holds one layout: re-quantize or re-save the checkpoint.")

    def _shapes(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``name``'s dequantized shape read as published and as blocked along the output."""
        *lead, rows, groups, _ = self.inner.shape(name + BLOCKS)
        return (*lead, groups * BLOCK, rows), (*lead, rows, groups * BLOCK)

    def _along_out(self, name: str) -> bool:
        return name in self.along_out or (name in self._square and bool(self.along_out))

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.quantized:
            return tuple(self.inner.shape(name))
        return self._shapes(name)[self._along_out(name)]

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
        *lead, ins, outs = region
        along_out = self._along_out(name)
        rows, (b0, b1) = (ins, outs) if along_out else (outs, ins)  # stored rows; blocked dim
        groups = (b0 // BLOCK, -(-b1 // BLOCK))
        blocks = self.inner.read(name + BLOCKS, (*lead, rows, groups, (0, BLOCK // 2)))
        scales = self.inner.read(name + SCALES, (*lead, rows, groups))
        out = dequantize(blocks, scales, dtypes.to_torch(self.out_dtype))  # [..., blocked, rows]
        start = groups[0] * BLOCK
        out = out[..., b0 - start:b1 - start, :]
        return (out.transpose(-1, -2) if along_out else out).contiguous()


class DenseBlocksReader(WrappedReader):
    """A folder whose dense weights ``X`` are stored as ``X_blocks`` (floating, no ``X_scales``,
    no quantization_config): what transformers 5.23's ``save_pretrained`` writes for a GPT-OSS
    loaded with ``Mxfp4Config(dequantize=True)`` (the bf16 fine-tuning start many take). The
    tensors are read as ``X``; transformers itself loads such a folder with its experts
    initialized at random (a warning: MISSING)."""

    def __init__(self, inner: TensorSource, renamed: list[str]):
        self.inner, self.path = inner, getattr(inner, "path", None)
        self.renamed = set(renamed)
        self._names = [n[:-len(BLOCKS)] if n[:-len(BLOCKS)] in self.renamed else n
                       for n in inner.names]

    def _stored(self, name: str) -> str:
        return name + BLOCKS if name in self.renamed else name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.inner.shape(self._stored(name)))

    def dtype(self, name: str) -> Any:
        return self.inner.dtype(self._stored(name))

    def locate(self, name: str) -> Any:
        return self.inner.locate(self._stored(name))

    def byte_range(self, name: str, region: Any) -> Any:
        inner = getattr(self.inner, "byte_range", None)
        return None if inner is None else inner(self._stored(name), region)

    def read(self, name: str, region: tuple[tuple[int, int], ...]) -> torch.Tensor:
        return self.inner.read(self._stored(name), region)


def dense_blocks(reader: TensorSource) -> TensorSource:
    """``reader`` with dense expert weights stored under transformers' ``X_blocks`` names
    (``SAVED_DENSE``) read as ``X`` (``DenseBlocksReader``); ``reader`` itself when it holds
    none."""
    names = set(reader.names)
    renamed = [n[:-len(BLOCKS)] for n in names if n.endswith(SAVED_DENSE)
               and n[:-len(BLOCKS)] + SCALES not in names and n[:-len(BLOCKS)] not in names
               and dtypes.of(reader.dtype(n)).is_floating_point]
    return DenseBlocksReader(reader, sorted(renamed)) if renamed else reader


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

