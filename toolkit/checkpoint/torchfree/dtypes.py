"""Dtypes by name, so that a dtype's name and size need no ``import torch``.

Why: ``import torch`` takes 1.3 s on a 2-core machine, longer than copying a 1B model's 2.3 GiB
(0.7 s). A conversion that only moves bytes from file to file (no cast, whole rows: issue 15)
needs a dtype's name and size, never a tensor, so the converter passes ``DType`` values and
reaches torch through ``toolkit.lazy.torch``, a module proxy that imports it on first use.

``DType`` compares equal to the torch dtype of the same name (either side of ``==``), so readers
that hand out real torch dtypes (legacy, DeepSpeed) and those that hand out ``DType`` mix; dict
keys and torch calls need ``to_torch`` / ``of``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolkit.lazy import torch


@dataclass(frozen=True, eq=False)
class DType:
    name: str  # torch's attribute name: "bfloat16"
    itemsize: int
    is_floating_point: bool
    safetensors: str  # the safetensors header's code: "BF16"

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return name_of(other) == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def torch(self) -> Any:
        return getattr(torch, self.name)


_ALL = [DType("float64", 8, True, "F64"), DType("float32", 4, True, "F32"),
        DType("float16", 2, True, "F16"), DType("bfloat16", 2, True, "BF16"),
        DType("int64", 8, False, "I64"), DType("int32", 4, False, "I32"),
        DType("int16", 2, False, "I16"), DType("int8", 1, False, "I8"),
        DType("uint8", 1, False, "U8"), DType("bool", 1, False, "BOOL"),
        DType("float8_e4m3fn", 1, True, "F8_E4M3"), DType("float8_e5m2", 1, True, "F8_E5M2")]
BY_NAME = {d.name: d for d in _ALL}
BY_SAFETENSORS = {d.safetensors: d for d in _ALL}
FLOAT32, BFLOAT16, FLOAT16 = BY_NAME["float32"], BY_NAME["bfloat16"], BY_NAME["float16"]
#: The precisions a run or a conversion is asked for by name (``train.precision``, ``--dtype``):
#: the one table; the torch dtypes are ``PRECISIONS[name].torch``, the sizes ``.itemsize``.
PRECISIONS = {"bf16": BFLOAT16, "fp16": FLOAT16, "fp32": FLOAT32}
UINT8, FLOAT8_E4M3 = BY_NAME["uint8"], BY_NAME["float8_e4m3fn"]


def name_of(obj: Any) -> str | None:
    """``"bfloat16"`` for ``torch.bfloat16`` or its ``DType`` (any torch dtype, also those no
    checkpoint here stores); None for anything else. Recognises torch's dtypes by their class
    (``torch.dtype``), so torch need not be imported."""
    if isinstance(obj, DType):
        return obj.name
    cls = type(obj)
    if cls.__module__ == "torch" and cls.__name__ == "dtype":
        return str(obj).removeprefix("torch.")
    return None


def of(dtype: Any) -> DType:
    """The ``DType`` of a torch dtype, a ``DType`` or a name (``bfloat16``, ``torch.bfloat16``)."""
    if isinstance(dtype, DType):
        return dtype
    name = name_of(dtype) or str(dtype).removeprefix("torch.")
    if name not in BY_NAME:
        raise ValueError(f"dtype {dtype!r} is not one a checkpoint stores here; "
                         f"use one of {', '.join(BY_NAME)}.")
    return BY_NAME[name]


def to_torch(dtype: Any) -> Any:
    """The torch dtype of a ``DType`` (a torch dtype or None passes through)."""
    return dtype.torch if isinstance(dtype, DType) else dtype
