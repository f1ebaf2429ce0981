"""FP8 checkpoints (DeepSeek-V3's layout) dequantized on read (``toolkit.checkpoint.fp8``).

Tiny checkpoints are quantized by ``toolkit.convert.fp8_quantize`` (blockwise amax / 448,
non-square blocks so a row/column mix-up shows; 128 x 128 on a shape that is not a multiple of
128), then converted: every output value must equal the reference dequantization bit-exactly,
and the logits of the converted models (and of the FP8 folder loaded live) must match
transformers run on the dequantized weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_checks import adapter_checks as ac
from dist_checks import convert_checks
from safetensors.torch import save_file
from typer.testing import CliRunner

from toolkit.adapters.spec import read_hf_config
from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.fp8 import FP8, SCALE
from toolkit.checkpoint.hf import HFReader, open_reader
from toolkit.convert import convert, inspect
from toolkit.convert.fp8_quantize import quantize, quantize_folder, tensors_of, write_folder
from toolkit.parallel.layout import ParallelLayout as L

BLOCK = (32, 48)  # tiny shapes (64, 96): partial blocks in both dimensions
FAMILIES = ("llama", "phi3", "mixtral")  # tied + plain, fused qkv / gate_up, experts
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
              "activation_scheme": "dynamic"}


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``q.float() * scale_inv`` with every scale repeated over its block (written
    independently of the reader's ``fp8.dequantize``, as the reference it is checked against)."""
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[:q.shape[0], :q.shape[1]]


def dequantize_folder(src: Path, dst: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The reference for an FP8 folder ``src`` (what transformers runs): quantized weights as
    ``fp8.float() * scale``, then every floating tensor cast to ``dtype`` (as ``--dtype``)."""
    config = json.loads((src / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    tensors = tensors_of(src)
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE):
            continue
        if t.dtype == FP8:
            t = dequantized(t, tensors[name + SCALE], block)  # type: ignore[arg-type]
        out[name] = t.to(dtype) if t.is_floating_point() else t
    return write_folder(dst, src, out, config)


def _folder(path: Path, tensors: dict, quant: dict | None) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"dtype": "bfloat16", **({"quantization_config": quant} if quant else {})}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _open(path: Path, out_dtype: torch.dtype | None = None):
    """The folder's reader, its config.json read as every command reads it (one reader)."""
    return open_reader(path, read_hf_config(path), out_dtype)


def test_reader_reads_only_the_blocks_of_a_region(tmp_path):
    """128 x 128 blocks on a 300 x 200 weight: any region equals the reference's, reading only
    the fp8 rows/columns asked for and the scales of the blocks they touch."""
    torch.manual_seed(0)
    w = torch.randn(300, 200) * 0.05
    q, s = quantize(w, (128, 128))
    assert s.shape == (3, 2) and q.dtype == torch.float8_e4m3fn
    ref = dequantized(q, s, (128, 128))
    assert (ref - w).abs().max() < 0.05 * w.abs().max()  # e4m3: 3 mantissa bits
    path = _folder(tmp_path / "q", {"a.weight": q, "a.weight" + SCALE: s,
                                    "n.weight": torch.ones(4)}, FP8_CONFIG)
    with _open(path, torch.float32) as r:
        assert sorted(r.names) == ["a.weight", "n.weight"]  # scales are not weights
        assert r.dtype("a.weight") == torch.float32 and r.dtype("n.weight") == torch.float32
        for (a, b), (c, d) in (((0, 300), (0, 200)), ((5, 260), (100, 199)),
                               ((129, 130), (127, 129)), ((256, 300), (128, 200))):
            r.reads.clear()
            assert torch.equal(r.read("a.weight", ((a, b), (c, d))), ref[a:b, c:d])
            fp8 = sum(x.nbytes for x in r.reads if x.name == "a.weight")
            scales = [x.region for x in r.reads if x.name == "a.weight" + SCALE]
            assert fp8 == (b - a) * (d - c)  # one byte per element of the region, no more
            assert all(reg[1] == (c // 128, -(-d // 128)) for reg in scales)
            assert len(scales) == len(range(a // 128, -(-b // 128)))
    with _open(path) as r:  # default: the checkpoint's dtype
        assert torch.equal(r.read("a.weight", ((0, 300), (0, 200))), ref.to(torch.bfloat16))
        # file-to-file copies: the stored bytes of an unquantized tensor, never of a weight
        assert r.byte_range("a.weight", ((0, 300), (0, 200))) is None
        file, offset, length = r.byte_range("n.weight", ((1, 3),))
        with open(file, "rb") as f:
            f.seek(offset)
            assert f.read(length) == torch.ones(2).numpy().tobytes() and length == 8


@pytest.mark.parametrize(("quant", "match"), [
    ({**FP8_CONFIG, "quant_method": "gptq"}, "quant_method='gptq' is not supported"),
    ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme='static'"),
    ({**FP8_CONFIG, "weight_block_size": None}, "weight_block_size=None"),
])
def test_refuses_unsupported_quantization(tmp_path, quant, match):
    path = _folder(tmp_path / "q", {"n.weight": torch.ones(4)}, quant)
    with pytest.raises(CheckpointError, match=match):
        _open(path)


def test_refuses_damaged_scales(tmp_path):
    q, s = quantize(torch.randn(300, 200), (128, 128))
    with pytest.raises(CheckpointError, match="has no a.weight_scale_inv"):
        _open(_folder(tmp_path / "a", {"a.weight": q}, FP8_CONFIG))
    with pytest.raises(CheckpointError, match=r"needs \(3, 2\)"):
        _open(_folder(tmp_path / "b", {"a.weight": q, "a.weight" + SCALE: s[:2]},
                            FP8_CONFIG))


@pytest.fixture(scope="module")
def fp8_models(tiny_root):
    """Per family: the FP8 folder, its fp32 and bf16 references, and conversions of it."""
    out = {}
    for family in FAMILIES:
        base = tiny_root / "fp8" / family
        q = quantize_folder(tiny_root / family, base / "fp8", BLOCK)
        out[family] = {"fp8": q, "ref32": dequantize_folder(q, base / "ref32"),
                       "ref16": dequantize_folder(q, base / "ref16", torch.bfloat16),
                       "base": base}
        # fp8 -> mcore (tp2, fp32) -> hf: the values must survive bit-exactly
        convert(q, base / "m", "mcore", L(tp=2), dtype="fp32", progress=False, verify=True)
        convert(base / "m", base / "m_hf", "hf", progress=False)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_converts_to_the_dequantized_values(fp8_models, family):
    m = fp8_models[family]
    with HFReader(m["fp8"]) as r:
        assert any(r.dtype(n) == torch.float8_e4m3fn for n in r.names)
    # to HF bf16: every tensor equals the helper's dequantization, cast once to bf16
    report = convert(m["fp8"], m["base"] / "hf16", "hf", dtype="bf16", progress=False,
                     verify=True)
    assert report.verified == report.tensors
    for got, want in ((m["base"] / "hf16", m["ref16"]), (m["base"] / "m_hf", m["ref32"])):
        cmp = ac.compare_tensors(want, got)
        assert cmp["n"] > 0 and cmp == {**cmp, "only_a": [], "only_b": [], "unequal": []}, cmp
        config = json.loads((got / "config.json").read_text())
        assert "quantization_config" not in config
    hf_config = json.loads((m["base"] / "m" / "hf_config" / "config.json").read_text())
    assert "quantization_config" not in hf_config


def test_inspect_shows_fp8(fp8_models, tiny_root):
    from toolkit.cli import app

    path = fp8_models["llama"]["fp8"]
    info = inspect(path)
    assert info.problems == [] and info.quantization.startswith("fp8 e4m3, 32x48 block")
    assert info.dtypes["float8_e4m3fn"] == 4 * 7  # q k v o gate up down per layer
    assert info.parameters == inspect(tiny_root / "llama").parameters  # scales not counted
    res = CliRunner().invoke(app, ["inspect", str(path)])
    assert res.exit_code == 0 and "quantized:    fp8 e4m3" in res.output, res.output


def test_fp8_logits_match_transformers_on_dequantized_weights(fp8_models, rank_pool_1):
    """megatron-core on the converted torch_dist checkpoints and on the FP8 folder loaded live
    (``hf-mcore``) vs transformers on the fp32 dequantized folder (in the session's one-rank
    pool, CPU mode on there, as test_convert's verify runners)."""
    pairs = []
    for family in FAMILIES:
        m = fp8_models[family]
        pairs += [(str(m["ref32"]), f"mcore:{m['base'] / 'm'}")]
    m = fp8_models["llama"]
    pairs.append((str(m["ref32"]), f"hf-mcore:{m['fp8']}"))
    pairs.append((str(m["ref32"]), f"hf-mcore:{m['base'].parent.parent / 'llama'}"))
    [rows] = rank_pool_1.run(convert_checks.verify_many, pairs, timeout=600)
    assert len(rows) == len(pairs)
    *good, unquantized = rows
    worst = {r["spec"]: r["max_abs"] for r in good if not r["max_abs"] <= 1e-4}
    assert not worst, worst
    assert unquantized["max_abs"] > 1e-2  # the original weights differ: the check can fail
