"""``torch.save`` records written without torch: a tensor whose bytes are copied file to file,
never through memory (``save_segments``), and plain objects (``dumps``, ``save_bytes``).

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

Pickles are written by the pure-Python pickler with ``dcp_pickle``'s stand-ins for torch's names
(dtypes, storage classes, ``_rebuild_tensor_v2``), protocol 2 as ``torch.save``'s.
"""

from __future__ import annotations

import io
import sys
from collections import OrderedDict
from typing import IO, Any

from toolkit.checkpoint import CheckpointError, dcp_pickle, dtypes, torch_zip
from toolkit.checkpoint import segments as seg
from toolkit.checkpoint.segments import Segment

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
