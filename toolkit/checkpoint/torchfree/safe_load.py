"""Loading untrusted pickle-based checkpoint files without running code from them.

Every ``.pt`` / ``.bin`` the converter reads goes through ``load_torch``: ``torch.load`` with
``weights_only=True`` plus an explicit allowlist. Megatron-LM stores its run arguments as an
``argparse.Namespace`` (allowed) whose values may include ``signal.Signals`` members (allowed:
rebuilt by value) and megatron enums or classes; those are
replaced by inert placeholders (``Opaque``) that only record their name and arguments: they can
never execute anything, and the tensors are untouched.

DCP's ``.metadata`` (torch_dist checkpoints) is a plain pickle: ``load_dcp_metadata`` reads it
with an unpickler that resolves only DCP's metadata class names (to plain stand-ins:
``dcp_pickle``), ``torch.Size`` and dtypes.
"""

from __future__ import annotations

import argparse
import io
import pickle
import signal
import zipfile
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.torchfree import dcp_pickle, dtypes
from toolkit.lazy import torch

#: Modules whose globals (in a checkpoint's ``args``) become inert placeholders.
OPAQUE_PREFIXES = ("megatron.", "transformer_engine.", "apex.", "deepspeed.", "enum.")

#: Stdlib classes allowed as themselves: Megatron-LM (since core_v0.16.0) stores
#: ``args.exit_signal`` as a ``signal.Signals`` member; unpickling calls ``Signals(value)``, which
#: only looks up an existing enum member (no code from the file runs).
ALLOWED_STDLIB: dict[str, Any] = {"signal.Signals": signal.Signals}


class Opaque:
    """Stand-in for a class or enum stored in a checkpoint's metadata (never executed)."""

    qualname = "?"
    args: tuple[Any, ...] = ()  # unpickling may bypass __init__ (NEWOBJ + __setstate__)

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


def _opaque(name: str) -> type:
    return type(name.rsplit(".", 1)[-1], (Opaque,), {"qualname": name})


def load_torch(path: str | Path, *, mmap: bool = True) -> Any:
    """``torch.load(path, weights_only=True)`` with Namespace allowed and megatron classes inert.

    Raises CheckpointError naming the file when it is truncated or holds other globals.
    """
    path = Path(path)
    allowed: list[Any] = [argparse.Namespace]
    legacy = path.is_file() and not zipfile.is_zipfile(path)
    try:  # the old (non-zip) format cannot be listed: weights_only refuses its globals itself
        unsafe = [] if legacy else torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as err:  # noqa: BLE001 - any parse failure means a damaged file
        raise CheckpointError(f"{path}: cannot read it as a torch checkpoint ({err}); the file "
                              "is damaged or truncated.") from err
    if legacy:
        allowed += list(ALLOWED_STDLIB.values())
        mmap = False  # only zip files can be memory-mapped
    refused = []
    for name in unsafe:
        if name == "argparse.Namespace":
            continue
        if name in ALLOWED_STDLIB:
            allowed.append(ALLOWED_STDLIB[name])
            continue
        if name.startswith(OPAQUE_PREFIXES):
            allowed.append((_opaque(name), name))
        else:
            refused.append(name)
    if refused:
        raise CheckpointError(f"{path} contains objects that are not weights ({', '.join(refused)})"
                              "; refusing to unpickle them. Re-save the tensors only.")
    # Add only what is not registered yet: leaving the context removes what it added, and
    # megatron-core registers Namespace itself at import.
    present = torch.serialization.get_safe_globals()
    allowed = [a for a in allowed if a not in present]
    with torch.serialization.safe_globals(allowed):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as err:
            if mmap and "mmap" in str(err):  # legacy (non-zip) files cannot be memory-mapped
                return load_torch(path, mmap=False)
            raise CheckpointError(f"{path}: cannot load ({err}); the file is damaged or "
                                  "truncated.") from err
        except (pickle.UnpicklingError, EOFError, ValueError) as err:
            if legacy and "Unsupported global" in str(err):
                raise CheckpointError(f"{path} (old non-zip format) contains objects that are "
                                      f"not weights ({err}); refusing to unpickle them. "
                                      "Re-save the tensors only.") from err
            raise CheckpointError(f"{path}: cannot load ({err}).") from err


class _NotPlain(Exception):
    """The file holds tensors or classes ``load_plain`` does not read: ``load_torch`` does."""


class _PlainReader(pickle.Unpickler):
    """A ``torch.save`` pickle of plain values (Megatron-LM's ``common.pt``: run arguments,
    iteration, versions): dtypes become ``dtypes.DType``, megatron classes inert; a tensor or any
    other class stops it (``_NotPlain``)."""

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full == "argparse.Namespace":
            return argparse.Namespace
        if full == "collections.OrderedDict":
            return dict
        if module == "torch" and name in dtypes.BY_NAME:
            return dtypes.BY_NAME[name]
        if full in ALLOWED_STDLIB:
            return ALLOWED_STDLIB[full]
        if full.startswith(OPAQUE_PREFIXES):
            return _opaque(full)
        raise _NotPlain(full)

    def persistent_load(self, pid: Any) -> Any:
        raise _NotPlain("a tensor")


def load_plain(path: str | Path) -> Any:
    """A ``torch.save`` file of plain values, read without importing torch (1.3 s, longer than
    a small conversion's copy); None when it holds more (tensors, other classes) or is not a
    zip file: then ``load_torch`` reads it with its allowlist and errors."""
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")]
            if len(pkl) != 1:
                return None
            return _PlainReader(io.BytesIO(zf.read(pkl[0]))).load()
    except (_NotPlain, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError,
            TypeError, AttributeError, OSError):
        return None


def load_dcp_metadata(path: str | Path) -> Any:
    """The ``Metadata`` of a DCP ``.metadata`` file, unpickled with an allowlist into plain
    stand-ins (``dcp_pickle``: no DCP class is imported or constructed)."""
    path = Path(path)
    try:
        return dcp_pickle.Reader(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path}: not a readable torch.distributed.checkpoint metadata "
                              f"file ({err}).") from err
