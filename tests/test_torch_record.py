"""HF -> torch_dist copies tensor bytes file to file into torch.save records (torch_record)."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

FIXTURE = (Path(__file__).resolve().parent.parent / "../shared/fixtures"
           / "megatron-lm-core_v0.16.1" / "hf-llama-tiny")


@pytest.mark.parametrize("fast", [True, False])
def test_save_segments_is_torch_save(tmp_path, monkeypatch, fast):
    """The record is torch.save's own framing around the copied bytes (zero runs included):
    same entries at the same offsets, same length, loads bit-exactly, and the reader finds
    its data where torch.save puts it; also without copy_file_range."""
    from toolkit.checkpoint import mcore_dist, torch_record

    if not fast:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    t = torch.randn(37, 24).to(torch.bfloat16)
    t[30:] = 0
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100 + raw[: 30 * 48] + b"y" * 7)
    segs = torch_record.merge([(src, 100, 10 * 48), (src, 100 + 10 * 48, 20 * 48),
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
        start = mcore_dist._saved_tensor_start(f, 4, n, (37, 24), torch.bfloat16)
    assert out.read_bytes()[start:start + len(raw)] == raw
    with pytest.raises(Exception, match="segments hold"):
        with open(tmp_path / "bad", "wb") as f:
            torch_record.save_segments(f.fileno(), (37, 24), torch.bfloat16, segs[:1])


def test_hf_to_mcore_copies_file_to_file(tmp_path, monkeypatch):
    """HF (fp32) -> torch_dist at tp2 (vocab padding rows, fused QKV, [gate; up]): every chunk is
    copied as byte ranges, the result reads back bit-exactly (--verify; megatron-core's own
    dist_checkpointing.load of these outputs is checked in test_convert.py); a --dtype bf16 cast
    takes the memory path and holds the same numbers."""
    from toolkit.checkpoint import mcore_dist, torch_record
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
