"""The bytes ``torch.save`` writes (torch 2.13), produced without importing torch.

Why: ``import torch`` costs 1.3 s, more than the whole file-to-file conversion of a 1B model
may take (issue 15). A ``torch.save`` file is a zip archive written by torch's
``PyTorchStreamWriter`` (miniz) around a protocol-2 pickle; both are reproduced here byte for
byte (tests/test_torch_record.py compares whole files with ``torch.save``'s).

The archive (``torch.serialization._save`` defaults: CRC32s on, 64-byte storage alignment,
byteorder record): entries ``data.pkl``, ``.format_version``, ``.storage_alignment``,
``byteorder``, ``data/0``..., ``version``, ``.data/serialization_id``, stored (no compression),
each local header padded by an ``FB`` extra field so that the entry's data starts at a multiple
of 64, sizes and CRC in a data descriptor after the data (none after an empty entry), then
the central directory, the zip64 end record and locator (always written) and the end record;
zip64 extra fields where an entry's size or header offset reaches 2**32 - 1, as miniz writes
them.

``.data/serialization_id`` is deterministic, not random: 20 digits of a hash of the set of
record names (libstdc++'s ``std::hash`` of each name combined in the iteration order of an
``unordered_set``: a constant for a given set of names, stored here for archives of 0 and 1
storages) and 20 digits of ``c10::hash_combine`` over the CRC32s of the data descriptors in
write order.
"""

from __future__ import annotations

import struct
import sys
import zlib
from collections.abc import Sequence

from toolkit.checkpoint import CheckpointError

ALIGN = 64  # torch.utils.serialization.config.save.storage_alignment
_MAX = 0xFFFFFFFF  # sizes and offsets from here on are zip64
_UTF8 = 0x0800  # names are UTF-8
_FLAGS = 0x0808  # UTF-8 names; a data descriptor follows the data
_LOCAL, _DESCRIPTOR, _CENTRAL = 0x04034B50, 0x08074B50, 0x02014B50
_END64, _LOCATOR64, _END = 0x06064B50, 0x07064B50, 0x06054B50
_MASK = (1 << 64) - 1
#: The record-name part of ``.data/serialization_id`` by number of storages (``data/<i>``
#: records); tests compare both with torch's.
NAME_HASH = {0: 2908468677762923104, 1: 15728199511854643026}
#: ``caffe2::serialize::kProducedFileFormatVersion`` as ``torch.save`` records it.
VERSION = b"3\n"


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK) + (seed >> 2)) & _MASK)) & _MASK


class _Archive:
    """miniz's stored-entry zip writer as ``PyTorchStreamWriter`` drives it."""

    def __init__(self) -> None:
        self.parts: list[bytes | int] = []
        self.central: list[bytes] = []
        self.pos = 0
        self.crc_hash = 0

    def _emit(self, part: bytes | int, size: int) -> None:
        if isinstance(part, bytes) and self.parts and isinstance(self.parts[-1], bytes):
            self.parts[-1] += part
        else:
            self.parts.append(part)
        self.pos += size

    def add(self, name: str, data: bytes | int, size: int, crc: int) -> None:
        """Entry ``archive/<name>``: ``data`` bytes, or the index of data the caller writes."""
        full = f"archive/{name}".encode()
        offset = self.pos
        big_size, big_offset = size >= _MAX, offset >= _MAX
        local64 = [size, 0] * big_size + [offset] * big_offset  # comp. size unknown up front
        z64 = struct.pack(f"<HH{len(local64)}Q", 1, 8 * len(local64), *local64) if local64 else b""
        pad = -(offset + 30 + len(full) + 4 + len(z64)) % ALIGN
        extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        flags = _FLAGS if size else _UTF8  # an empty entry has no data descriptor
        self._emit(struct.pack("<IHHHHHIIIHH", _LOCAL, 0, flags, 0, 0, 0, 0, 0, 0, len(full),
                               len(extra)) + full + extra, 30 + len(full) + len(extra))
        if size:
            self._emit(data, size)
            self._emit(struct.pack("<IIQQ" if z64 else "<IIII", _DESCRIPTOR, crc, size, size),
                       24 if z64 else 16)
            self.crc_hash = _hash_combine(self.crc_hash, crc)  # the CRCs of the descriptors
        central64 = [size, size] * big_size + [offset] * big_offset
        cextra = (struct.pack(f"<HH{len(central64)}Q", 1, 8 * len(central64), *central64)
                  if central64 else b"")
        self.central.append(struct.pack(
            "<IHHHHHHIIIHHHHHII", _CENTRAL, 0, 0, flags, 0, 0, 0, crc, min(size, _MAX),
            min(size, _MAX), len(full), len(cextra), 0, 0, 0, 0, min(offset, _MAX))
            + full + cextra)

    def finish(self) -> list[bytes | int]:
        directory = b"".join(self.central)
        start, n = self.pos, len(self.central)
        end64 = self.pos + len(directory)
        self._emit(directory + struct.pack(
            "<IQHHIIQQQQ", _END64, 44, 0x031E, 0x002D, 0, 0, n, n, len(directory), start)
            + struct.pack("<IIQI", _LOCATOR64, 0, end64, 1)
            + struct.pack("<IHHHHIIH", _END, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                          min(len(directory), _MAX), min(start, _MAX), 0), 0)
        return self.parts


def torch_save_parts(pickled: bytes, storages: Sequence[tuple[int, int]] = ()
                     ) -> list[bytes | int]:
    """The file ``torch.save`` writes for an object whose pickle (``data.pkl``) is ``pickled``
    and whose storages ``data/<i>`` are ``(nbytes, crc32)`` each, as a list of byte strings
    and storage indices ``i`` (where the caller writes storage ``i``'s ``nbytes`` bytes)."""
    if len(storages) not in NAME_HASH:
        raise CheckpointError(f"{len(storages)} storages: only records of 0 or 1 storages are "
                              "written without torch; save this object with torch.save.")
    zf = _Archive()
    for name, data in (("data.pkl", pickled), (".format_version", b"1"),
                       (".storage_alignment", str(ALIGN).encode()),
                       ("byteorder", sys.byteorder.encode())):
        zf.add(name, data, len(data), zlib.crc32(data))
    for i, (nbytes, crc) in enumerate(storages):
        zf.add(f"data/{i}", i, nbytes, crc)
    zf.add("version", VERSION, len(VERSION), zlib.crc32(VERSION))
    sid = f"{NAME_HASH[len(storages)]:020d}{zf.crc_hash:020d}".encode()
    zf.add(".data/serialization_id", sid, len(sid), zlib.crc32(sid))
    return zf.finish()
