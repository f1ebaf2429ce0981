"""DCP's ``.metadata`` pickle, read and written without importing ``torch.distributed.checkpoint``.

Why: importing DCP's metadata classes pulls in DTensor, ``torch.fx`` and sympy (0.6 s on a quiet
2-core machine, 1.5 s under load): after ``import torch`` the largest fixed cost of a torch_dist
conversion. The file is a plain pickle of a few dataclasses, so plain stand-ins with the same
fields do both jobs: reading (the restricted unpickler resolves the allowed DCP names to these
classes, so no torch class is ever constructed from the file) and writing (``dumps`` pickles the
stand-ins under the real classes' names, field for field, so torch, megatron-core and
Megatron-LM load the real classes). Dtypes come back as ``dtypes.DType`` (by name: reading
imports no torch); ``torch.Size`` as a tuple subclass.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from toolkit.checkpoint.torchfree import dtypes

META = "torch.distributed.checkpoint.metadata"
FILESYSTEM = "torch.distributed.checkpoint.filesystem"
PLANNER = "torch.distributed.checkpoint.planner"
#: ``torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION`` of the torch this writes as
#: (a test compares it with the installed torch).
DCP_VERSION = "1.0.0"


class Global:
    """A module-level name pickled as a reference (``GLOBAL``, ``STACK_GLOBAL``), e.g.
    ``torch.bfloat16``."""

    def __init__(self, module: str, name: str):
        self._global = (module, name)

    def __reduce_ex__(self, protocol: int) -> str:
        return self._global[1]  # a str: pickled by ``save_global`` as a global reference

    def __call__(self, *args: Any) -> Any:  # pickle wants reduce functions to be callable
        raise TypeError(f"{'.'.join(self._global)} is a stand-in, not callable.")

    def __repr__(self) -> str:
        return ".".join(self._global)


class Call:
    """``func(*args)`` pickled as ``REDUCE``: how torch pickles layouts and enum members."""

    def __init__(self, func: Global, *args: Any):
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


class Record:
    """A DCP dataclass as plain attributes: unpickled (``NEWOBJ`` + ``BUILD``) and pickled
    (``NEWOBJ`` + its ``__dict__``) as the dataclass is; enum members (``REDUCE`` of the class
    on a value) keep their arguments."""

    _global: tuple[str, str] = ("", "")

    def __init__(self, *args: Any):
        self.args = args

    @classmethod
    def make(cls, **fields: Any) -> Any:
        """An instance with ``fields`` in the real class's field order (what it pickles)."""
        obj = cls.__new__(cls)
        obj.__dict__.update(fields)
        return obj

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a slots dataclass
            for part in state:
                self.__dict__.update(part or {})
        else:
            self.__dict__.update(state or {})


def _record(module: str, name: str, **defaults: Any) -> type[Record]:
    """A stand-in named ``module.name``; ``defaults``: the real dataclass's field defaults
    (class attributes, so a file that omits those fields reads as torch would read it)."""
    return type(name, (Record,), {"_global": (module, name), **defaults})


class Size(tuple):
    """``torch.Size``: pickled as ``torch.Size((...))``."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return TORCH_SIZE, (tuple(self),)


class TensorProperties(Record):
    """DCP's ``TensorProperties``, whose pickled state is a tuple (dtype, layout,
    requires_grad, memory format, pin_memory)."""

    _global = (META, "TensorProperties")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):  # as a plain dataclass (older torch)
            self.__dict__.update(state)
            return
        (self.dtype, self.layout, self.requires_grad, self.memory_format,
         self.pin_memory) = state

    def __getstate__(self) -> tuple[Any, ...]:
        return self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory


TORCH_SIZE = Global("torch", "Size")
_GET_LAYOUT = Global("torch.serialization", "_get_layout")
Metadata = _record(META, "Metadata", planner_data=None, storage_data=None, storage_meta=None,
                   version=None)
TensorStorageMetadata = _record(META, "TensorStorageMetadata")
BytesStorageMetadata = _record(META, "BytesStorageMetadata")
ChunkStorageMetadata = _record(META, "ChunkStorageMetadata")
MetadataIndex = _record(META, "MetadataIndex", offset=None, index=None)
StorageMeta = _record(META, "StorageMeta", checkpoint_id=None, save_id=None, load_id=None)
MemFormat = _record(META, "_MEM_FORMAT_ENCODING")
StorageInfo = _record(FILESYSTEM, "_StorageInfo", transform_descriptors=None)
#: The two values every tensor of a converted checkpoint has (one object each, as in torch).
STRIDED = Call(_GET_LAYOUT, "torch.strided")
CONTIGUOUS = Call(MemFormat, 0)  # _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT

#: What a ``.metadata`` may name, and the class each name is read as (the allowlist of
#: ``safe_load.load_dcp_metadata``).
ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): Size,
    ("torch.serialization", "_get_layout"): str,  # the layout's name, e.g. "torch.strided"
    ("collections", "OrderedDict"): dict,
    **{c._global: c for c in (Metadata, TensorStorageMetadata, BytesStorageMetadata,
                              ChunkStorageMetadata, MetadataIndex, StorageMeta, MemFormat,
                              StorageInfo, TensorProperties)},
    **{(PLANNER, n): _record(PLANNER, n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType")},
}

_DTYPES: dict[str, Global] = {}


def dtype_ref(dtype: Any) -> Global:
    """``torch.<dtype>`` (a torch dtype, a ``DType`` or a name) as a pickled reference (one
    object per dtype, as torch's are)."""
    name = dtypes.name_of(dtype) or str(dtype).removeprefix("torch.")
    return _DTYPES.setdefault(name, Global("torch", name))


class _Writer(pickle._Pickler):  # type: ignore[misc, name-defined]
    """The pure-Python pickler, writing stand-ins and dtypes (torch's or stand-ins) as
    references to the real names: ``STACK_GLOBAL`` from protocol 4, ``GLOBAL`` below (what the
    C pickler writes for torch's dtypes and classes)."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if type(obj) not in self.dispatch and (name := dtypes.name_of(obj)) is not None:
            obj = dtype_ref(name)  # one object per dtype (a memo reference after the first)
        super().save(obj, save_persistent_id)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        ref = getattr(obj, "_global", None)
        if ref is None:
            super().save_global(obj, name)
            return
        if self.proto >= 4:
            self.save(ref[0])
            self.save(ref[1])
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{ref[0]}\n{ref[1]}\n".encode())
        self.memoize(obj)


def dumps(metadata: Any) -> bytes:
    """The ``.metadata`` bytes of a stand-in ``Metadata`` (DCP's default protocol, >= 4)."""
    buf = io.BytesIO()
    _Writer(buf, protocol=max(4, pickle.DEFAULT_PROTOCOL)).dump(metadata)
    return buf.getvalue()


class Reader(pickle.Unpickler):
    """Resolves only ``ALLOWED`` names and torch dtypes; everything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return ALLOWED[(module, name)]
        if module == "torch" and name in dtypes.BY_NAME:
            return dtypes.BY_NAME[name]
        raise pickle.UnpicklingError(f"global {module}.{name} is not a DCP metadata class")
