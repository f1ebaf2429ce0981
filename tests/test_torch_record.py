"""HF -> torch_dist copies tensor bytes file to file into torch.save records (torch_record),
written without torch byte for byte as torch.save writes them (torch_zip)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

FIXTURE = (Path(__file__).resolve().parent.parent / "../shared/fixtures"
           / "megatron-lm-core_v0.16.1" / "hf-llama-tiny")
#: Every dtype torch_record writes: legacy storage classes, then the untyped (v3) ones.
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.uint16, torch.uint32,
          torch.uint64, torch.bits8, torch.bits16]


class _SkipDataSink:
    """What ``torch.save`` writes under ``skip_data``: byte strings, and ``n`` where it seeks
    over a storage's ``n`` bytes (the framing of a record, without its data)."""

    def __init__(self):
        self.parts: list = [b""]
        self.pos = 0

    def write(self, data):
        data = bytes(memoryview(data).cast("B"))
        self.parts[-1] += data
        self.pos += len(data)
        return len(data)

    def seek(self, n, whence=0):
        assert whence == os.SEEK_CUR
        self.parts += [n, b""]
        self.pos += n
        return self.pos

    def tell(self):
        return self.pos

    def flush(self):
        pass


def _skip_data_save(t) -> list:
    sink = _SkipDataSink()
    with torch.serialization.skip_data():
        torch.save(t, sink)
    return [p for p in sink.parts if p != b""]


def _raw(t) -> bytes:
    """The bytes of ``t``'s storage."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,)).numpy().tobytes()


def _torch_save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _record(tmp_path, shape, dtype, segments, crc) -> bytes:
    from toolkit.checkpoint.torchfree import torch_record

    out = tmp_path / "record"
    with open(out, "wb") as f:
        f.write(b"lead")
        f.flush()
        n = torch_record.save_segments(f.fileno(), shape, dtype, segments, crc=crc)
    data = out.read_bytes()[4:]
    assert n == len(data)
    return data


def test_records_are_torch_save_bytes(tmp_path):
    """For every dtype and shapes () (0,) (1,) (3,4) (2,3,5): with crc=True the record is
    torch.save's file byte for byte; by default the same but for the data entry's CRC32 (0,
    in the descriptor, the central directory and serialization_id's CRC part), i.e. what
    torch.save writes under skip_data; torch.load(weights_only=True) reads both back."""
    from toolkit.checkpoint.torchfree import torch_zip

    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for shape in [(), (0,), (1,), (3, 4), (2, 3, 5)]:
            t = torch.empty(shape, dtype=dtype)
            raw = torch.randint(0, 256, (t.untyped_storage().nbytes(),), dtype=torch.uint8,
                                generator=gen)
            t.untyped_storage().copy_(raw.untyped_storage())
            raw_bytes = _raw(t)
            (tmp_path / "src").write_bytes(b"ab" + raw_bytes)
            segs = [(tmp_path / "src", 2, len(raw_bytes))] if raw_bytes else []
            ref = _torch_save(t)
            assert _record(tmp_path, shape, dtype, segs, crc=True) == ref, (dtype, shape)
            got = _record(tmp_path, shape, dtype, segs, crc=False)
            skip = _skip_data_save(t)
            filled = b"".join(p if isinstance(p, bytes) else raw_bytes for p in skip)
            assert got == filled, (dtype, shape)
            assert len(got) == len(ref) and (got == ref) == (not raw_bytes), (dtype, shape)
            for data in (got, ref):
                back = torch.load(io.BytesIO(data), weights_only=True)
                assert (back.dtype, back.shape, back.stride()) == (dtype, t.shape, t.stride())
                assert _raw(back) == raw_bytes, (dtype, shape)
    with zipfile.ZipFile(io.BytesIO(got)) as z:  # deterministic, as torch's
        sid = z.read("archive/.data/serialization_id").decode()
    assert sid[:20] == f"{torch_zip.NAME_HASH[1]:020d}"


def test_record_of_segments_and_zeros(tmp_path):
    """A 1 MiB bf16 tensor from ranges of two files and a zero run, written after other
    bytes of the file: torch.save's bytes (crc=True), and its data where torch.save puts it."""
    from toolkit.checkpoint.torchfree import segments, torch_record

    t = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    t[300:400] = 0
    raw = _raw(t)
    row = 2048
    (tmp_path / "a").write_bytes(b"x" * 10 + raw[: 100 * row])
    (tmp_path / "b").write_bytes(raw[100 * row: 300 * row] + raw[400 * row:])
    segs = [(tmp_path / "a", 10, 60 * row), (tmp_path / "a", 10 + 60 * row, 40 * row),
            (tmp_path / "b", 0, 200 * row), (None, 0, 100 * row),
            (tmp_path / "b", 200 * row, 112 * row)]
    merged = segments.merge(segs)
    assert len(merged) == 4
    data = _record(tmp_path, (512, 1024), torch.bfloat16, merged, crc=True)
    assert data == _torch_save(t)
    plain = _record(tmp_path, (512, 1024), torch.bfloat16, merged, crc=False)
    assert plain == b"".join(p if isinstance(p, bytes) else raw for p in _skip_data_save(t))
    with open(tmp_path / "record", "rb") as f:
        start = torch_record.tensor_start(f, 4, len(plain), (512, 1024), torch.bfloat16)
    assert (tmp_path / "record").read_bytes()[start:start + len(raw)] == raw


def test_zip64_framing_is_torch_saves():
    """Records of 4 GiB and more (zip64 sizes, then zip64 header offsets) and around the
    limits: the framing is torch.save's (compared under skip_data: no data is written)."""
    from toolkit.checkpoint.torchfree import torch_record, torch_zip

    limit = 0xFFFFFFFF
    for dtype, n in [(torch.uint8, limit - 849), (torch.uint8, limit - 721),
                     (torch.uint8, limit - 720), (torch.uint8, limit - 1), (torch.uint8, limit),
                     (torch.bfloat16, 2**31 + 5), (torch.float8_e4m3fn, 5 * 2**30)]:
        mine = torch_zip.torch_save_parts(
            torch_record._pickle(torch_record._tensor((n,), dtype)), [(n * dtype.itemsize, 0)])
        theirs = _skip_data_save(torch.empty((n,), dtype=dtype))
        assert theirs[1] == n * dtype.itemsize  # the one seek over the data
        assert mine == [theirs[0], 0, *theirs[2:]], (dtype, n)  # 0: storage 0's data here


def _DType(name: str, itemsize: int):
    """A dtype as the converter's torch-free path has it: a ``dtypes.DType`` (a new object each
    call, equal to the one of ``dtypes.BY_NAME``)."""
    from toolkit.checkpoint.torchfree import dtypes

    return dtypes.DType(name, itemsize, True, dtypes.BY_NAME[name].safetensors)


def test_objects_are_torch_save_bytes(tmp_path):
    """common.pt (Megatron-LM's args with a dtype among them) and the _extra_state [None]:
    dumps writes torch.save's bytes, with torch's dtypes or stand-ins of them, and they load
    back as the object; tensors and dtypes torch writes otherwise are refused."""
    from toolkit.checkpoint import CheckpointError, megatron_meta
    from toolkit.checkpoint.torchfree import dcp_pickle, torch_record
    from toolkit.checkpoint.torchfree.safe_load import load_torch
    from toolkit.convert.sources import adapter_from_folder
    from toolkit.parallel.layout import ParallelLayout

    adapter = adapter_from_folder(FIXTURE)

    def common(dtype):
        args = megatron_meta.megatron_args(adapter, ParallelLayout(tp=2), adapter.padded_vocab(2),
                                        None, "torch_dist", torch.bfloat16,
                                        tokenizer_model="/ckpt/hf_config")
        args.params_dtype = dtype
        args.main_grads_dtype = dtype  # the same dtype twice: a memo reference the second time
        args.extra = [1.5, -2, 2**40, None, True, "x" * 300, (1, 2), {"k": dtype}]
        return {"args": args, "checkpoint_version": megatron_meta.CHECKPOINT_VERSION,
                "iteration": 0, "num_floating_point_operations_so_far": 0,
                "content_metadata": dict(megatron_meta.CONTENT_METADATA)}

    ref = _torch_save(common(torch.bfloat16))
    assert b"ctorch\nbfloat16\n" in ref
    for dtype in (torch.bfloat16, dcp_pickle.dtype_ref(torch.bfloat16), _DType("bfloat16", 2)):
        assert torch_record.dumps(common(dtype)) == ref, dtype
    two = common(_DType("bfloat16", 2))  # two stand-ins of one dtype: one reference, as torch's
    two["args"].main_grads_dtype = _DType("bfloat16", 2)
    assert torch_record.dumps(two) == ref
    (tmp_path / "common.pt").write_bytes(torch_record.dumps(common(_DType("bfloat16", 2))))
    assert vars(load_torch(tmp_path / "common.pt")["args"]) == vars(
        common(torch.bfloat16)["args"])
    assert torch_record.dumps([None]) == _torch_save([None])
    with open(tmp_path / "blob", "wb") as f:
        f.write(b"x")
        assert torch_record.save_bytes(f, [None]) == len(_torch_save([None]))
        f.flush()
        assert torch_record.save_bytes(f.fileno(), [None]) == len(_torch_save([None]))
    assert (tmp_path / "blob").read_bytes() == b"x" + 2 * _torch_save([None])
    assert torch.load(io.BytesIO(torch_record.dumps([None])), weights_only=True) == [None]
    with pytest.raises(CheckpointError, match="torch.save"):
        torch_record.dumps({"w": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="torch.save"):
        torch_record.save_segments(os.open(os.devnull, os.O_WRONLY), (2,), torch.int4, [])


def test_torch_record_imports_no_torch():
    """The file-to-file path writes records without importing torch (1.3 s); nor does any
    module of the byte layer it stands on import torch at import time."""
    code = ("import sys; from toolkit.checkpoint.torchfree import dcp_pickle, dtypes, safe_load, "
            "segments, torch_record, torch_zip; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("fast", [True, False])
def test_save_segments_is_torch_save(tmp_path, monkeypatch, fast):
    """The record is torch.save's own framing around the copied bytes (zero runs included):
    same entries at the same offsets, same length, loads bit-exactly, and the reader finds
    its data where torch.save puts it; also without copy_file_range."""
    from toolkit.checkpoint.torchfree import segments, torch_record

    if not fast:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    t = torch.randn(37, 24).to(torch.bfloat16)
    t[30:] = 0
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100 + raw[: 30 * 48] + b"y" * 7)
    segs = segments.merge([(src, 100, 10 * 48), (src, 100 + 10 * 48, 20 * 48),
                               (None, 0, 3 * 48), (None, 0, 4 * 48)])
    assert segs == [(src, 100, 30 * 48), (None, 0, 7 * 48)]
    out = tmp_path / "out"
    with open(out, "wb") as f:
        f.write(b"lead")
        f.flush()
        n = torch_record.save_segments(f.fileno(), (37, 24), torch.bfloat16, segs)
    ref = io.BytesIO()
    torch.save(t, ref)
    data = out.read_bytes()[4:]
    assert n == len(data) == len(ref.getvalue())
    got = torch.load(io.BytesIO(data), weights_only=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16),
                                                        t.view(torch.int16))
    za, zb = zipfile.ZipFile(io.BytesIO(data)), zipfile.ZipFile(ref)
    assert [(i.filename, i.header_offset, i.file_size) for i in za.infolist()] == [
        (i.filename, i.header_offset, i.file_size) for i in zb.infolist()]
    with open(out, "rb") as f:
        start = torch_record.tensor_start(f, 4, n, (37, 24), torch.bfloat16)
    assert out.read_bytes()[start:start + len(raw)] == raw
    with pytest.raises(Exception, match="segments hold"):
        with open(tmp_path / "bad", "wb") as f:
            torch_record.save_segments(f.fileno(), (37, 24), torch.bfloat16, segs[:1])


def test_hf_to_mcore_copies_file_to_file(tmp_path, monkeypatch):
    """HF (fp32) -> torch_dist at tp2 (vocab padding rows, fused QKV, [gate; up]): every chunk is
    copied as byte ranges, the result reads back bit-exactly (--verify; megatron-core's own
    dist_checkpointing.load of these outputs is checked in test_convert.py); a --dtype bf16 cast
    takes the memory path and holds the same numbers."""
    from toolkit.checkpoint import mcore_dist
    from toolkit.checkpoint.torchfree import torch_record
    from toolkit.convert import convert
    from toolkit.parallel.layout import ParallelLayout

    copied: list[tuple] = []
    orig = torch_record.save_segments
    monkeypatch.setattr(torch_record, "save_segments",
                        lambda fd, shape, dtype, segs: (copied.append(shape),
                                                        orig(fd, shape, dtype, segs))[1])
    r = convert(FIXTURE, tmp_path / "m", "mcore", ParallelLayout(tp=2), progress=False,
                verify=True, fsync=True)
    assert r.verified == r.tensors and len(copied) > 0
    ckpt = mcore_dist.DistCheckpoint.open(tmp_path / "m")
    chunks = sum(len(md.chunks) for md in ckpt.tensors.values())
    assert len(copied) == chunks
    emb = ckpt.read("embedding.word_embeddings.weight", ())
    vocab = json.loads((FIXTURE / "config.json").read_text())["vocab_size"]
    assert emb.shape[0] >= vocab and bool((emb[vocab:] == 0).all())

    copied.clear()
    r2 = convert(FIXTURE, tmp_path / "m16", "mcore", ParallelLayout(tp=2), dtype="bf16",
                 progress=False, verify=True)
    assert r2.verified == r2.tensors and copied == []
    # the two paths hold the same numbers
    ck16 = mcore_dist.DistCheckpoint.open(tmp_path / "m16")
    for key, md in ckpt.tensors.items():
        for c in md.chunks:
            prefix = tuple(c.offsets)[:mcore_dist.stacked_axes(key)]
            got = ck16.read(key, prefix)
            assert got.dtype == torch.bfloat16, key
            assert torch.equal(ckpt.read(key, prefix).to(torch.bfloat16), got), key


def test_hf_target_carries_the_config_through_without_transformers(tmp_path):
    """HF -> torch_dist -> HF: config.json is the source's (dtype as the weights'), read by
    transformers as the source's is; generation_config.json is the source's file. (That the
    converter does not import transformers for it: test_cli_startup.py.)"""
    from transformers import AutoConfig

    from toolkit.convert import convert
    from toolkit.parallel.layout import ParallelLayout

    convert(FIXTURE, tmp_path / "m", "mcore", ParallelLayout(tp=2), progress=False)
    convert(tmp_path / "m", tmp_path / "h", "hf", progress=False, dtype="bf16")
    src, got = (json.loads((p / "config.json").read_text()) for p in (FIXTURE, tmp_path / "h"))
    assert got.pop("dtype") == "bfloat16" and src.pop("dtype") == "float32"
    assert got == src
    a, b = (AutoConfig.from_pretrained(p).to_dict() for p in (FIXTURE, tmp_path / "h"))
    for d in (a, b):
        d.pop("_name_or_path")
    assert (a.pop("dtype"), b.pop("dtype")) == ("float32", "bfloat16") and a == b
    assert ((tmp_path / "h" / "generation_config.json").read_bytes()
            == (FIXTURE / "generation_config.json").read_bytes())
