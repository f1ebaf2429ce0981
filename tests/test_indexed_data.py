"""Megatron indexed datasets: the writer and merge against megatron-core's IndexedDatasetBuilder
(byte for byte), ``mdtk data preprocess`` against Megatron-LM's tokenisation (megatron-core's
own HuggingFaceTokenizer + builder; the real ``preprocess_data.py`` in
test_check_megatron_lm_training.py), DeepSpeed-written indexes, the blend and the stream, and
every bad input refused before anything is built or written.
"""

from __future__ import annotations

import filecmp
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from toolkit import bundled
from toolkit.cli import app
from toolkit.train.data import DataError, DataSettings, GlobalBatchSampler, prepare_data
from toolkit.train.data.indexed_format import (
    IndexWriter,
    dtype_for_vocab,
    merge,
    read_index,
)
from toolkit.train.data.preprocess import TokenizeSpec, preprocess
from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

BUNDLED = bundled.path(bundled.DATA) / "pretrain.jsonl"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """Bundled documents plus the awkward ones: empty, whitespace, unicode, a special token's
    text, newlines, a long one."""
    texts = [json.loads(x)["text"] for x in BUNDLED.read_text().splitlines()][:300]
    return texts + ["", " ", "é 中文 🙂", "a<|endoftext|>b", "line\n\nbreak", "x " * 3000, ""]


def _megatron_reference(texts: list[str], tokenizer: str, prefix: Path, *,
                        append_eod: bool = True, special: bool = False) -> None:
    """What Megatron-LM's preprocess_data.py writes: megatron-core's HuggingFaceTokenizer
    (``tokenize`` / ``eod`` / ``vocab_size``) and IndexedDatasetBuilder, one document at a
    time, as its Encoder and Partition do."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from megatron.core.tokenizers import MegatronTokenizer

    t = MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer,
                                          metadata_path={"library": "huggingface"},
                                          include_special_tokens=special)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(t.vocab_size))
    for text in texts:
        ids = t.tokenize(text)
        lens = [len(ids)] if ids else []
        if ids and append_eod:
            ids = [*ids, t.eod]
            lens[-1] += 1
        builder.add_document(ids, lens)
    builder.finalize(f"{prefix}.idx")


def _same(a: str | Path, b: str | Path) -> bool:
    return all(filecmp.cmp(f"{a}.{e}", f"{b}.{e}", shallow=False) for e in ("bin", "idx"))


def test_writer_and_merge_match_megatron_core_builder(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    parts = []
    for p, dtype in enumerate((np.uint16, np.uint16, np.uint16)):
        lengths = rng.integers(0, 50, 200)  # zeros: empty documents (a boundary, no sequence)
        ids = rng.integers(0, 60000, int(lengths.sum())).astype(dtype)
        ours = IndexWriter(tmp_path / f"ours{p}", dtype)
        for a in range(0, 200, 64):  # several batches
            sl = slice(int(lengths[:a].sum()), int(lengths[:a + 64].sum()))
            ours.add(ids[sl], lengths[a:a + 64])
        ours.finalize()
        theirs = IndexedDatasetBuilder(str(tmp_path / f"theirs{p}.bin"), dtype=dtype)
        start = 0
        for n in lengths:
            theirs.add_document(ids[start:start + n], [int(n)] if n else [])
            start += n
        theirs.finalize(str(tmp_path / f"theirs{p}.idx"))
        assert _same(tmp_path / f"ours{p}", tmp_path / f"theirs{p}")
        parts.append(str(tmp_path / f"theirs{p}"))
    merged = IndexedDatasetBuilder(str(tmp_path / "merged_ref.bin"), dtype=np.uint16)
    for p in parts:
        merged.add_index(p)
    merged.finalize(str(tmp_path / "merged_ref.idx"))
    info = merge(parts, tmp_path / "merged")
    assert _same(tmp_path / "merged", tmp_path / "merged_ref")
    assert info.documents == 600 and info.writer == "megatron-core"
    assert not list(tmp_path.glob(".*tmp*"))  # temporary siblings renamed or removed


def test_preprocess_equals_megatron_lm_workers_shards_formats(tok, docs, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(docs)))
    _megatron_reference(docs, tok, tmp_path / "ref")
    spec = TokenizeSpec(tok, append_eod=True)
    for workers in (1, 2):
        s = preprocess([str(src)], spec, str(tmp_path / f"w{workers}"), workers=workers,
                       batch_docs=37, progress=False)
        assert _same(s.outputs["text"], tmp_path / "ref"), workers
        assert s.documents == len(docs)
    shards = []
    for i in range(3):
        s = preprocess([str(src)], spec, str(tmp_path / "sh"), shard=(i, 3), batch_docs=50,
                       progress=False)
        shards.append(s.outputs["text"])
    assert merge(shards, tmp_path / "merged").documents == len(docs)
    assert _same(tmp_path / "merged", tmp_path / "ref")
    stamp = Path(f"{shards[1]}.idx").stat().st_mtime_ns
    again = preprocess([str(src)], spec, str(tmp_path / "sh"), shard=(1, 3), progress=False)
    assert again.skipped and Path(f"{shards[1]}.idx").stat().st_mtime_ns == stamp  # not redone
    # the same documents from .jsonl.gz and Parquet, split over two files: the same bytes
    import datasets

    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs[:100])
    datasets.Dataset.from_dict({"text": docs[100:]}).to_parquet(tmp_path / "b.parquet")
    s = preprocess([str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.parquet")], spec,
                   str(tmp_path / "mixed"), workers=2, progress=False)
    assert _same(s.outputs["text"], tmp_path / "ref")
    # with the tokenizer's special tokens (Megatron-LM's --tokenizer-hf-include-special-tokens)
    _megatron_reference(docs, tok, tmp_path / "ref_special", special=True)
    s = preprocess([str(src)], TokenizeSpec(tok, append_eod=True, include_special_tokens=True),
                   str(tmp_path / "special"), progress=False)
    assert _same(s.outputs["text"], tmp_path / "ref_special")


def test_preprocess_cli_and_inspect(tok, tmp_path):
    runner = CliRunner()
    out = runner.invoke(app, ["data", "preprocess", str(BUNDLED), "--tokenizer", tok,
                              "--output-prefix", str(tmp_path / "c"), "--append-eod",
                              "--workers", "2", "--quiet"])
    assert out.exit_code == 0, out.output
    assert "1,600 documents" in out.output and "docs/s" in out.output
    info = runner.invoke(app, ["inspect", str(tmp_path / "c_text_document")])
    assert info.exit_code == 0, info.output
    idx = read_index(tmp_path / "c_text_document")
    for want in ("uint16 (code 8: megatron-core's dtype codes)", f"{idx.tokens:,}",
                 "documents:    1,600"):
        assert want in info.output, info.output
    ids = np.fromfile(tmp_path / "c_text_document.bin", dtype=np.uint16)
    assert f"largest id:   {int(ids.max())}" in info.output
    merged = runner.invoke(app, ["data", "merge", str(tmp_path / "c_text_document.idx"),
                                 str(tmp_path / "c_text_document"), "--output-prefix",
                                 str(tmp_path / "twice")])
    assert merged.exit_code == 0 and read_index(tmp_path / "twice").documents == 3200


def _deepspeed_prefix(path: Path, dtype, docs: list[np.ndarray]) -> str:
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import (
        MMapIndexedDatasetBuilder,
    )

    b = MMapIndexedDatasetBuilder(f"{path}.bin", dtype=dtype)
    for d in docs:
        b.add_item_numpy(d)
        b.end_document()
    b.finalize(f"{path}.idx")
    return str(path)


def test_deepspeed_written_index_read_correctly(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from toolkit.train.data.gpt_sources import readable_prefix

    rng = np.random.default_rng(1)
    for dtype, code in ((np.uint16, 6), (np.uint32, 7), (np.uint64, 8)):
        docs = [rng.integers(0, 60000, int(n)).astype(dtype) for n in rng.integers(1, 40, 30)]
        prefix = _deepspeed_prefix(tmp_path / f"ds_{code}", dtype, docs)
        info = read_index(prefix)
        assert (info.code, info.dtype, info.writer) == (code, np.dtype(dtype), "DeepSpeed")
        # megatron-core alone misreads it (its code 6/7/8 are float64 / float32 / uint16)
        assert IndexedDataset(prefix).index.dtype != np.dtype(dtype)
        readable = IndexedDataset(readable_prefix(info, tmp_path / "cache"))
        for i, d in enumerate(docs):
            assert np.array_equal(readable[i], d.astype(np.int64))
        shown = CliRunner().invoke(app, ["inspect", prefix]).output
        assert f"code {code}: DeepSpeed's dtype codes" in shown and "largest id" in shown


def test_bad_inputs_refused_before_anything_is_written(tok, tmp_path):
    from toolkit.train.config import ConfigError, load_config
    from toolkit.train.data.pretrain import check_token_ids

    good = IndexWriter(tmp_path / "good", np.uint16)
    good.add(np.arange(1, 400, dtype=np.uint16), np.array([100, 199, 100]))
    good.finalize()
    shutil.copy(tmp_path / "good.idx", tmp_path / "nobin.idx")
    with pytest.raises(DataError, match=r"nobin\.idx has no nobin\.bin beside it"):
        read_index(tmp_path / "nobin")
    shutil.copy(tmp_path / "good.idx", tmp_path / "short.idx")
    (tmp_path / "short.bin").write_bytes((tmp_path / "good.bin").read_bytes()[:-10])
    with pytest.raises(DataError, match=r"holds 788 bytes but its index describes 399 tokens of 2 "
                                        r"bytes \(798 bytes\): the \.bin is truncated"):
        read_index(tmp_path / "short")
    raw = bytearray((tmp_path / "good.idx").read_bytes())
    raw[17] = 6  # megatron-core's float64 code, but 2 bytes per token: DeepSpeed's uint16
    (tmp_path / "recoded.idx").write_bytes(bytes(raw))
    shutil.copy(tmp_path / "good.bin", tmp_path / "recoded.bin")
    assert read_index(tmp_path / "recoded").writer == "DeepSpeed"
    f64 = IndexWriter(tmp_path / "f64", np.int64)  # 8 bytes per token under code 6: float64
    f64.add(np.arange(10), np.array([10]))
    f64.finalize()
    raw = bytearray((tmp_path / "f64.idx").read_bytes())
    raw[17] = 6
    (tmp_path / "f64.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="float64 token ids for megatron-core"):
        read_index(tmp_path / "f64")
    with pytest.raises(DataError, match=r"1,000 tokens; ids up to 999 do not fit uint8"):
        dtype_for_vocab(1000, "uint8")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(DataError, match="do not fit uint8"):  # checked before any file is made
        preprocess([str(BUNDLED)], TokenizeSpec(tok, dtype="uint8"), str(tmp_path / "u8"),
                   progress=False)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"token id 399 is at or above the model's vocab size "
                                        r"\(300\)"):
        check_token_ids([str(tmp_path / "good")], cache, vocab=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no cache
    check_token_ids([str(tmp_path / "good")], cache, vocab=512)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'run'}\nmodel: {{config: "
                   f"{bundled.path(bundled.TINY_LLAMA_CONFIG)}, tokenizer: {tok}}}\n"
                   f"data: {{mode: pretrain, sources: [{tmp_path / 'good'}, {BUNDLED}]}}\n"
                   "train: {steps: 1}\n")
    cases = {
        "data.weights=[1]": "data.weights has 1 values for 2 data.sources",
        "data.weights=[0.5,-1]": "every weight must be > 0 (got -1",
        f"data.sources=[{tmp_path / 'nobin'}]": "has no nobin.bin beside it",
        f"data.sources=[{tmp_path / 'short'}]": "the .bin is truncated",
        "data.mode=sft": "is an indexed dataset (token ids without loss masks)",
        "data.shuffle=false": "data.shuffle=false applies to sft only",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=None) as err:
            load_config(str(cfg), [override])
        assert message in str(err.value), (override, str(err.value))
    assert not (tmp_path / "run").exists()


def _prefix(path: Path, low: int, high: int, docs: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 60, docs)
    w = IndexWriter(path, np.uint16)
    w.add(rng.integers(low, high, int(lengths.sum())), lengths)
    w.finalize()
    return str(path)


def test_blend_weights_stream_and_megatron_lm_samples(tok, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.utils import normalize

    from toolkit.train.data.gpt_sources import gpt_config

    a = _prefix(tmp_path / "a", 10, 200, 400, 0)  # ids tell the sources apart
    b = _prefix(tmp_path / "b", 300, 490, 900, 1)
    s = DataSettings(mode="pretrain", sources=(a, b), seq_len=32, seed=7, validation_split=0.0,
                     weights=(0.25, 0.75))
    data = prepare_data(s, tok, tmp_path / "cache")
    data.train.reserve(1000)
    counts = data.train.source_counts(0, 1000)
    assert abs(counts[0] / 1000 - 0.25) <= 0.01 and abs(counts[1] / 1000 - 0.75) <= 0.01
    batch = data.train.batch(np.arange(1000))
    from_a = (batch["tokens"] < 200).all(dim=1) & (batch["tokens"] >= 10).all(dim=1)
    from_b = (batch["tokens"] >= 300).all(dim=1)
    assert np.array_equal(from_a.numpy(), data.train.sources_of(np.arange(1000)) == 0)
    assert (from_a | from_b).all()
    # prefix-stable: a longer run reads the same first 1000 samples
    longer = prepare_data(s, tok, tmp_path / "cache2")
    longer.train.reserve(100_000)
    assert np.array_equal(longer.train.batch(np.arange(1000))["tokens"], batch["tokens"])
    # inside one epoch of each source: what Megatron-LM's builder gives for a 1000-sample run
    facts = data.train.datasets[0].gpt.config.tokenizer
    config = gpt_config(32, 7, facts, None)  # BlendedDataset caches only under a process group
    config.blend = ([a, b], [0.25, 0.75])
    config.split, config.split_matrix = "100,0,0", [(0.0, 1.0), None, None]
    theirs = BlendedMegatronDatasetBuilder(GPTDataset, [1000, 0, 0], lambda: True,
                                           config).build()[0]
    assert np.allclose(normalize([0.25, 0.75]), [0.25, 0.75])
    for i in range(0, 1000, 7):
        assert np.array_equal(theirs[i]["tokens"], batch["tokens"][i]), i
    # beyond one epoch of source a (about 250 samples): a seeded permutation, all samples
    n = data.train.datasets[0].n
    epoch1 = [data.train.datasets[0][n + i]["tokens"] for i in range(n)]
    epoch0 = [data.train.datasets[0].gpt[i]["tokens"] for i in range(n)]
    key = sorted(tuple(t.tolist()) for t in epoch1)
    assert key == sorted(tuple(t.tolist()) for t in epoch0)
    assert any(not np.array_equal(x, y) for x, y in zip(epoch0, epoch1, strict=True))
    # the sampler reads the stream in order, any dp: step s = positions [s*G, (s+1)*G)
    num, shuffle = data.train.sampler_args(True)
    assert shuffle is False and num >= 1000
    got = np.concatenate([m for r in range(2) for m in GlobalBatchSampler(
        num, 8, 2, 2, r, 7, shuffle).micro_batches(5)])
    assert got.tolist() == list(range(40, 48))
