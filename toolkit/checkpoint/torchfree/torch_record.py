"""``torch.save`` records without torch: written, a tensor whose bytes are copied file to file,
never through memory (``save_segments``), and plain objects (``dumps``, ``save_bytes``); read,
where a saved contiguous tensor's bytes start (``tensor_start``: a torch_dist chunk copied file
to file) and the tensor read with one copy straight into its storage (``read_tensor``).

A torch_dist data file (``__R_I.distcp``) is a sequence of ``torch.save``d tensors. When an
output tensor is a list of byte ranges of source files (whole rows of row-major tensors in the
same dtype: a layer's tensor, ``[gate; up]``, fused QKV, a vocab slice), ``save_segments``
writes the record's framing (zip headers, pickle, alignment, central directory: byte for byte
what ``torch.save`` writes, ``torch_zip``) and copies the ranges into its data entry with
``copy_file_range`` (``segments.copy_range``: in the kernel, as ``cp`` does; ``pread``/``write``
where the system refuses it): no tensor byte passes through user memory, and torch is not
imported (1.3 s).
The zip CRC32 of the copied data entry is 0, as in a ``torch.save`` under
``torch.serialization.skip_data``: computing it would read every byte; torch's reader does not
check CRCs. ``crc=True`` reads the bytes once more and writes the CRC: then the record is
``torch.save``'s file of that tensor exactly.

Reading parses the record's zip directory and its pickle with a probe that builds nothing (it
records the storage, offset, size and stride ``_rebuild_tensor_v2`` would get); any other record
(a view, a non-contiguous tensor, compression) gives None, and the caller uses ``torch.load``.

Pickles are written by the pure-Python pickler with ``dcp_pickle``'s stand-ins for torch's names
(dtypes, storage classes, ``_rebuild_tensor_v2``), protocol 2 as ``torch.save``'s.
"""

from __future__ import annotations

import io
import pickle
import re
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.torchfree import dcp_pickle, dtypes, torch_zip
from toolkit.checkpoint.torchfree import segments as seg
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.checkpoint.torchfree.segments import Segment
from toolkit.lazy import torch

#: dtype -> the legacy storage class ``torch.save`` names (``torch.storage``'s
#: ``_dtype_to_storage_type_map``): tensors rebuilt by ``_rebuild_tensor_v2``.
STORAGE_CLASS = {"float64": "DoubleStorage", "float32": "FloatStorage",
                 "float16": "HalfStorage", "int64": "LongStorage", "int32": "IntStorage",
                 "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
                 "bool": "BoolStorage", "bfloat16": "BFloat16Storage",
                 "complex128": "ComplexDoubleStorage", "complex64": "ComplexFloatStorage"}
#: dtypes ``torch.save`` writes as an ``UntypedStorage`` plus the dtype
#: (``torch.storage._new_dtypes``, ``_rebuild_tensor_v3``).
UNTYPED = frozenset({"float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",
                     "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8",
                     "bits2x4", "bits4x2", "complex32", "uint16", "uint32", "uint64"})
_REBUILD_V2 = dcp_pickle.Global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_V3 = dcp_pickle.Global("torch._utils", "_rebuild_tensor_v3")


class _Storage:
    """A tensor's storage in the pickle: written as its persistent id (``BINPERSID``)."""

    def __init__(self, pid: tuple[Any, ...]):
        self.pid = pid


class _Pickler(dcp_pickle._Writer):
    """``torch.save``'s pickler (protocol 2) over stand-ins; refuses torch's own tensors."""

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _Storage else None

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, (torch.Tensor, torch.UntypedStorage,
                                                  torch.storage.TypedStorage)):
            raise CheckpointError("an object holding torch tensors is written with torch.save, "
                                  "not torch_record.dumps.")
        return NotImplemented


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _tensor(shape: tuple[int, ...], dtype: Any) -> dcp_pickle.Call:
    """A contiguous CPU tensor as ``Tensor.__reduce_ex__`` describes it (its storage ``"0"``)."""
    name = dtypes.name_of(dtype)
    numel = 1
    for s in shape:
        numel *= s
    stride: list[int] = []
    step = 1
    for s in reversed(shape):
        stride.insert(0, step)
        step *= max(s, 1)
    size = tuple([*shape])  # a new tuple: the pickle memoizes by identity, as torch's
    if name in STORAGE_CLASS:
        pid = ("storage", dcp_pickle.Global("torch", STORAGE_CLASS[name]), "0", "cpu", numel)
        return dcp_pickle.Call(_REBUILD_V2, _Storage(pid), 0, size, tuple(stride), False,
                               OrderedDict())
    if name in UNTYPED:
        pid = ("storage", dcp_pickle.Global("torch.storage", "UntypedStorage"), "0", "cpu",
               numel * dtype.itemsize)
        return dcp_pickle.Call(_REBUILD_V3, _Storage(pid), 0, size, tuple(stride), False,
                               OrderedDict(), dcp_pickle.dtype_ref(dtype))
    raise CheckpointError(f"no torch-free torch.save record for dtype {dtype}: save this "
                          "tensor with torch.save.")


def save_segments(fd: int, shape: tuple[int, ...], dtype: Any, segments: list[Segment], *,
                  crc: bool = False) -> int:
    """Write at ``fd``'s position the ``torch.save`` record of a contiguous ``shape`` /
    ``dtype`` tensor whose bytes are ``segments`` in order; returns the record's length.

    ``dtype``: a torch dtype or a stand-in (``itemsize``, ``str`` ``"torch.<name>"``). The data
    entry's CRC32 is 0 unless ``crc`` (see the module docstring)."""
    pickled = _pickle(_tensor(tuple(shape), dtype))
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    have = sum(n for _, _, n in segments)
    if have != nbytes:
        raise CheckpointError(f"segments hold {have} bytes, a {tuple(shape)} {dtype} tensor "
                              f"needs {nbytes}.")
    parts = torch_zip.torch_save_parts(pickled, [(nbytes, seg.crc32(segments) if crc else 0)])
    for part in parts:
        if isinstance(part, bytes):
            seg.write_all(fd, part)
        else:
            seg.copy_segments(segments, fd)
    return sum(len(p) for p in parts if isinstance(p, bytes)) + nbytes


def dumps(obj: Any) -> bytes:
    """The ``torch.save`` file of ``obj``: plain Python values (dicts, lists, tuples, str,
    numbers, None, ``argparse.Namespace``, ...) and torch dtypes or their stand-ins; no
    tensors."""
    return b"".join(torch_zip.torch_save_parts(_pickle(obj)))  # type: ignore[arg-type]


def save_bytes(dest: int | IO[bytes], obj: Any) -> int:
    """Write ``dumps(obj)`` at ``dest`` (a file descriptor, at its position, or a binary file);
    returns the number of bytes written."""
    data = dumps(obj)
    if isinstance(dest, int):
        seg.write_all(dest, data)
    else:
        dest.write(data)
    return len(data)


# -- reading a record -------------------------------------------------------------------------

class _ProbeUnpickler(pickle.Unpickler):
    """Reads a torch.save pickle of one tensor without building it: records its layout."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size),
                                                                 tuple(stride))
        if module == "torch" and name.endswith("Storage"):
            return name
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return tuple(pid)


def tensor_start(f: Any, offset: int, length: int, sizes: tuple[int, ...],
                 dtype: torch.dtype) -> int | None:
    """Where the data of a contiguous tensor ``torch.save``d at ``f[offset:offset+length]``
    starts in the file (its bytes are stored there as they are, row-major); None when the
    record is anything else."""
    numel = 1
    for s in sizes:
        numel *= s
    window = _Window(f, offset, length)
    try:
        zf = zipfile.ZipFile(window)
        names = zf.namelist()
        data = [x for x in names if re.search(r"/data/\d+$", x)]
        pkl = [x for x in names if x.endswith("/data.pkl")]
        if len(data) != 1 or len(pkl) != 1:
            return None
        zi = zf.getinfo(data[0])
        if zi.compress_type != zipfile.ZIP_STORED or zi.file_size != numel * dtype.itemsize:
            return None
        storage, off, size, stride = _ProbeUnpickler(io.BytesIO(zf.read(pkl[0]))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, TypeError, KeyError,
            EOFError):
        return None
    want = []
    acc = 1
    for s in reversed(sizes):
        want.append(acc)
        acc *= s
    if off != 0 or size != tuple(sizes) or (numel > 1 and stride != tuple(reversed(want))):
        return None
    if not (isinstance(storage, tuple) and len(storage) >= 5 and storage[4] == numel):
        return None
    window.seek(zi.header_offset)
    head = window.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return None
    return offset + zi.header_offset + 30 + int.from_bytes(head[26:28], "little") + \
        int.from_bytes(head[28:30], "little")


def read_tensor(file: Path, offset: int, length: int, sizes: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor | None:
    """A contiguous tensor ``torch.save``d at ``file[offset:offset+length]``, read with one copy
    straight into its storage; None when the record is anything else (the caller then uses
    ``torch.load``)."""
    with open(file, "rb") as f:
        start = tensor_start(f, offset, length, sizes, dtype)
        if start is None:
            return None
        out = torch.empty(sizes, dtype=to_torch(dtype))
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        f.seek(start)
        pos = 0
        while pos < len(buf):
            got = f.readinto(buf[pos:])
            if not got:
                return None
            pos += got
        return out


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of an open file from ``offset``."""

    def __init__(self, f: Any, offset: int, length: int):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) or 0
        self.pos += got
        return got
