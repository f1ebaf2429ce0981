"""The converter's pipeline: read-ahead (reads overlap writes, two tensors in memory), --workers
auto, file-to-file copies, and the source interface every reader implements."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from toolkit.checkpoint.pipeline import read_ahead
from toolkit.convert.run import resolve_workers


def test_read_ahead_order_and_bound():
    """Items come back in order, produced ahead in a thread, with at most depth + 1 alive."""
    lock = threading.Lock()
    alive, peak, threads = 0, 0, set()

    def produce(i: int) -> int:
        nonlocal alive, peak
        with lock:
            alive += 1
            peak = max(peak, alive)
        threads.add(threading.current_thread().name)
        return i * i

    got = []
    for i, v in read_ahead(range(20), produce):
        time.sleep(0.005)  # a slow writer: the reader runs ahead as far as it may
        got.append((i, v))
        with lock:
            alive -= 1
    assert got == [(i, i * i) for i in range(20)]
    assert peak == 2
    assert threads == {"mdtk-read-ahead"}


def test_read_ahead_error_and_early_close():
    """A failing read raises at its item; leaving the loop early stops the thread."""
    def produce(i: int) -> int:
        if i == 3:
            raise OSError("disk gone")
        return i

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for i, _ in read_ahead(range(10), produce):
            seen.append(i)
    assert seen == [0, 1, 2]

    before = threading.active_count()
    gen = read_ahead(range(1000), lambda i: i)
    assert next(gen) == (0, 0)
    gen.close()
    assert threading.active_count() == before


def test_workers_auto():
    assert resolve_workers("auto") == max(1, (os.cpu_count() or 1) // 2)
    assert resolve_workers("3") == 3 and resolve_workers(2) == 2
    for bad in (0, "0", "many"):
        with pytest.raises(ValueError, match="--workers"):
            resolve_workers(bad)


FIXTURE = (Path(__file__).resolve().parent.parent / "../shared/fixtures"
           / "megatron-lm-core_v0.16.1" / "hf-llama-tiny")


def test_mcore_to_hf_copies_file_to_file(tmp_path, monkeypatch):
    """mcore -> HF of an mdtk torch_dist checkpoint (tp2 vocab padding, fused QKV and gate/up)
    copies every tensor as byte ranges (no read through memory) and is bit-exact."""
    import torch

    from toolkit.checkpoint import hf_writer
    from toolkit.checkpoint.hf import HFReader
    from toolkit.convert import convert
    from toolkit.parallel.layout import ParallelLayout

    copied = []
    orig = hf_writer.HFWriter.add_segments
    monkeypatch.setattr(hf_writer.HFWriter, "add_segments",
                        lambda self, name, segs: (copied.append(name), orig(self, name, segs)))
    convert(FIXTURE, tmp_path / "m", "mcore", ParallelLayout(tp=2), progress=False)
    report = convert(tmp_path / "m", tmp_path / "h", "hf", progress=False, verify=True,
                     fsync=True)
    assert report.verified == report.tensors == len(copied) == 39
    with HFReader(FIXTURE) as a, HFReader(tmp_path / "h") as b:
        assert sorted(a.names) == sorted(b.names)
        for n in a.names:
            full = tuple((0, k) for k in a.shape(n))
            assert torch.equal(a.read(n, full), b.read(n, full)), n


def test_copy_range_fallback(tmp_path, monkeypatch):
    """Without copy_file_range (another OS, a file system refusing it) the bytes are the same."""
    from toolkit.checkpoint.torchfree.segments import copy_range

    data = os.urandom(3 * 2**20 + 17)
    (tmp_path / "src").write_bytes(data)
    for fast in (True, False):
        if not fast:
            monkeypatch.delattr(os, "copy_file_range", raising=False)
        out = tmp_path / f"out{fast}"
        with open(tmp_path / "src", "rb") as s, open(out, "wb") as d:
            d.write(b"head")
            d.flush()
            copy_range(s.fileno(), 5, 2 * 2**20, d.fileno())
            copy_range(s.fileno(), 0, 5, d.fileno())
        assert out.read_bytes() == b"head" + data[5:5 + 2 * 2**20] + data[:5]


def test_will_need_hints_each_file_once_and_skips_what_it_cannot(tmp_path, monkeypatch):
    """The read-ahead hint: one open per file, every range of it advised WILLNEED; zero runs
    (file None), empty ranges and a missing file are skipped (the copy reports those)."""
    from toolkit.checkpoint.torchfree import segments

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(8192))
    b.write_bytes(bytes(4096))
    advised, opened = [], []
    real_open = os.open
    monkeypatch.setattr(segments.os, "posix_fadvise",
                        lambda fd, off, n, how: advised.append((os.readlink(f"/proc/self/fd/{fd}"),
                                                                off, n, how)))
    monkeypatch.setattr(segments.os, "open", lambda p, flags: opened.append(str(p)) or
                        real_open(p, flags))
    segments.will_need([(a, 0, 4096), (None, 0, 100), (b, 0, 4096), (a, 4096, 4096),
                        (b, 10, 0), (tmp_path / "missing", 0, 10)])
    assert opened == [str(a), str(b), str(tmp_path / "missing")]
    w = os.POSIX_FADV_WILLNEED
    assert advised == [(str(a), 0, 4096, w), (str(a), 4096, 4096, w), (str(b), 0, 4096, w)]


def test_every_reader_is_a_tensor_source():
    """The converter types its sources as ``TensorSource``: every reader has its members, and
    ``read`` takes (name, region)."""
    import inspect

    from toolkit.checkpoint.canonical import McoreFullSource
    from toolkit.checkpoint.deepspeed import HFNamedSource
    from toolkit.checkpoint.fp8 import DequantizingReader
    from toolkit.checkpoint.hf import HFReader
    from toolkit.checkpoint.source import TensorSource

    members = sorted(n for n in vars(TensorSource) if not n.startswith("_"))
    assert members == ["close", "dtype", "names", "read", "shape"]
    for cls in (HFReader, DequantizingReader, McoreFullSource, HFNamedSource):
        assert [m for m in members if not hasattr(cls, m)] == [], cls
        assert isinstance(inspect.getattr_static(cls, "names"), property), cls
        assert list(inspect.signature(cls.read).parameters)[:3] == ["self", "name", "region"]
