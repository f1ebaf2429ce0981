"""A host copy of a state dict that ``torch.save`` writes byte for byte as it would the original:
what an asynchronous checkpoint captures before the next optimizer step changes the live state.

How (each choice measured against the alternatives: docs/training.md, "Asynchronous saves"):

- the storages the state dict reaches are found the way ``torch.save`` finds them, by pickling it
  once into nothing with a ``persistent_id`` that records tensors and storages (so a module's
  parameters that are views of one flat ZeRO buffer stay views of one copied buffer, and the
  file holds the same storages in the same order);
- each storage is copied into a host buffer from ``StagingPool`` (reused from save to save: a
  copy into memory touched before runs at memory speed, 9.5 GB/s here, a fresh allocation pays a
  page fault per 4 KiB page, 1.7 GB/s; pinned for CUDA storages);
- tensors are rebuilt on the copies (offset, size, stride, ``requires_grad``, ``Parameter``,
  Python attributes) and put into a ``copy.deepcopy`` memo, so deepcopy copies the rest of the
  graph (dicts, ``OrderedDict`` metadata, DeepSpeed's loss scaler, the config) around them and
  keeps atomic objects (strings, numbers) the same objects: the pickle of the copy is the pickle
  of the original, reference for reference;
- a copied CUDA storage would be recorded as "cpu" by ``torch.save``: a serialization tagger
  (``register_package``, priority 1) names the device it was copied from, so GPU checkpoints are
  identical too.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading
from typing import Any

import torch

_ORIGIN: dict[int, torch.device] = {}  # data_ptr of a host copy -> its source's device
_TAGGER_LOCK = threading.Lock()
_TAGGER_ON = False


class _At:
    """What torch's taggers read of a storage: its device."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device):
        self.device = device


def _origin_tag(storage: Any) -> str | None:
    """The location torch would record for the copy's source, built anew by torch's own tagger
    at each call as for the source: pickle memoises strings by identity, so one string object
    reused for every view of a storage changed the file's bytes (H200, 2026-11-28)."""
    if isinstance(storage, _At) or not _ORIGIN:
        return None
    device = _ORIGIN.get(storage.data_ptr())
    return None if device is None else torch.serialization.location_tag(_At(device))


def _no_restore(storage: Any, location: str) -> None:
    return None  # loading is torch's own business: the next deserializer handles the location


def _register_tagger() -> None:
    global _TAGGER_ON
    with _TAGGER_LOCK:
        if not _TAGGER_ON:
            torch.serialization.register_package(1, _origin_tag, _no_restore)
            _TAGGER_ON = True


class StagingPool:
    """Host buffers for snapshots, kept for the run and reused at every save (the state dicts of
    one engine have the same storages every time). ``bytes`` counts what the pool holds."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._lent: list[tuple[tuple[int, bool], torch.UntypedStorage]] = []
        self.bytes = 0

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        key = (nbytes, pinned)
        free = self._free.get(key)
        buf = free.pop() if free else self._allocate(nbytes, pinned)
        self._lent.append((key, buf))
        return buf

    def _allocate(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        self.bytes += nbytes
        data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return data.untyped_storage()

    def reserve(self, sizes: list[tuple[int, bool]]) -> None:
        """Allocate and touch buffers of these sizes now (e.g. from the writer thread while the
        first steps run), so that the first snapshot copies at memory speed too."""
        for nbytes, pinned in sizes:
            buf = self._allocate(nbytes, pinned)
            torch.empty(0, dtype=torch.uint8).set_(buf).fill_(0)
            self._free.setdefault((nbytes, pinned), []).append(buf)

    def release(self) -> None:
        """Every buffer lent since the last release is free again (its file is written)."""
        for key, buf in self._lent:
            self._free.setdefault(key, []).append(buf)
            _ORIGIN.pop(buf.data_ptr(), None)
        self._lent.clear()


class _Finder(pickle.Pickler):
    """Pickles into nothing, recording every tensor and storage ``torch.save`` would write."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=2)
        self.tensors: dict[int, torch.Tensor] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}  # by _cdata, torch.save's key

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors[id(obj)] = obj
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            obj = obj._untyped_storage
        if isinstance(obj, torch.UntypedStorage):
            self.storages[obj._cdata] = obj
            return obj._cdata  # the storage's bytes are not pickled
        return None


def storages(state: Any) -> list[torch.UntypedStorage]:
    """The storages ``torch.save(state)`` would write, in the order it writes them."""
    finder = _Finder()
    finder.dump(state)
    return list(finder.storages.values())


def staging_sizes(state: Any) -> list[tuple[int, bool]]:
    """(bytes, pinned) of the buffers a snapshot of ``state`` takes from a ``StagingPool``."""
    return [(s.nbytes(), s.device.type == "cuda") for s in storages(state)]


def snapshot(state: Any, pool: StagingPool) -> Any:
    """A copy of ``state`` on host buffers of ``pool`` that later changes to ``state`` do not
    reach, and that ``torch.save`` writes exactly as it writes ``state`` now."""
    finder = _Finder()
    finder.dump(state)
    copies: dict[int, torch.UntypedStorage] = {}
    cuda = False
    for key, src in finder.storages.items():
        on_gpu = src.device.type == "cuda"
        buf = pool.take(src.nbytes(), pinned=on_gpu)
        buf.copy_(src, non_blocking=on_gpu)
        if src.device.type != "cpu":
            _register_tagger()
            _ORIGIN[buf.data_ptr()] = src.device
        copies[key] = buf
        cuda = cuda or on_gpu
    if cuda:
        torch.cuda.synchronize()  # the copies are complete before the next step runs
    memo: dict[Any, Any] = {"torch": dict(copies)}  # UntypedStorage.__deepcopy__'s own memo
    for tid, t in finder.tensors.items():
        memo[tid] = _rebuild(t, copies[t.untyped_storage()._cdata], memo)
    return copy.deepcopy(state, memo)


def _rebuild(t: torch.Tensor, buf: torch.UntypedStorage, memo: dict) -> torch.Tensor:
    """``t`` as a tensor on the host copy of its storage."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"cannot copy a {type(t).__name__} (a tensor subclass) for an "
                        "asynchronous save: set checkpoint.async=false.")
    out = torch.empty(0, dtype=t.dtype).set_(buf, t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
    elif t.requires_grad:
        out.requires_grad_(True)
    if t.__dict__:
        out.__dict__.update(copy.deepcopy(t.__dict__, memo))
    return out
