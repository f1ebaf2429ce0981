"""Pretraining data benchmarks: ``mdtk data preprocess`` against Megatron-LM's
``tools/preprocess_data.py``, and the start-up of a training run over a blend of many prefixes.

1. Preprocessing. A JSON Lines corpus of at least ``--mb`` MB is generated once (documents of
   50-2,000 words drawn Zipf-like from a 50,000-word synthetic vocabulary, so tokenizer caches
   see a realistic long tail) and a byte-level BPE tokenizer of ``--vocab`` tokens is trained on
   a sample of it. Then, per ``--workers`` value, ``--rounds`` rounds alternate Megatron-LM
   (``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR --append-eod``) and ``mdtk
   data preprocess`` (same flags) on the same file, same machine state; each round checks the
   two outputs are byte-identical. Reported: documents/s as each tool measures its processing
   (Megatron-LM's last ``Processed N documents (X docs/s)`` line; mdtk's summary line), the wall
   time of the whole command (Python start and imports included), CPU seconds and the peak RSS
   of the process tree; medians, spread (min-max) and the ratio mdtk / Megatron-LM.
2. Start-up over a blend. ``--prefixes`` small indexed datasets (written once) and a 1-step
   ``mdtk train`` pretraining the tiny Llama on all of them with weights: first start (empty
   data cache: every prefix's GPTDataset indices and the blend built) and second start (cache
   warm), wall time of the command and the data phase the trainer reports.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_data.py MEGATRON_LM_CHECKOUT \\
        [--mb 200] [--workers 1 2] [--rounds 3] [--prefixes 1000] [--work DIR] [--json OUT]
    python scripts/bench_data.py --gpu-train OUT.json     # scripts/gpu_check.py's part

3. ``--gpu-train OUT.json`` (one GPU, no Megatron-LM checkout): the bundled corpus in two halves
   made indexed datasets by ``mdtk data preprocess``, blended 0.25 / 0.75, and ``mdtk train``
   pretraining the tiny Llama on them for 30 steps in bf16 on one rank; written: the losses,
   tokens/s, the data phase and the share of each source's tokens.

Megatron-LM's tool needs two stand-ins here (``six``; the triton-only batch-invariant kernels
module), put on its ``PYTHONPATH`` by a generated ``sitecustomize.py``
(``check_megatron_lm_training.preprocess_env``).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_measure import MDTK, measure  # noqa: E402
from check_megatron_lm_training import megatron_preprocess_cmd, preprocess_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def make_corpus(path: Path, mb: int, seed: int = 0) -> int:
    """A JSON Lines file of at least ``mb`` MB; returns its document count (cached)."""
    import numpy as np

    if path.is_file() and path.stat().st_size >= mb << 20:
        return sum(1 for _ in open(path, "rb"))
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, int(n))) for n in rng.integers(1, 12, 50_000)]
    tmp = path.with_suffix(".tmp")
    docs = size = 0
    with open(tmp, "w") as f:
        while size < mb << 20:
            words = rng.zipf(1.2, int(rng.integers(50, 2000))) % len(vocab)
            text = " ".join(vocab[i] for i in words)
            if docs % 7 == 0:
                text = text.replace(" ", "\n", 3)
            line = json.dumps({"text": text, "id": docs}) + "\n"
            f.write(line)
            size += len(line)
            docs += 1
    tmp.rename(path)
    return docs


def make_tokenizer(out: Path, corpus: Path, vocab: int) -> Path:
    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    if (out / "tokenizer.json").is_file():
        return out
    with open(corpus) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(20_000), f, strict=False)]
    return build_tiny_tokenizer(out, texts=texts, vocab_size=vocab)


def megatron_docs_per_s(log: str) -> float:
    found = re.findall(r"Processed (\d+) documents \(([\d.]+) docs/s", log)
    if not found:
        raise SystemExit("no progress line in Megatron-LM's output:\n" + log[-2000:])
    return float(found[-1][1])


def mdtk_docs_per_s(log: str) -> float:
    found = re.findall(r"([\d,]+) docs/s", log)
    return float(found[-1].replace(",", ""))


def preprocess_rounds(checkout: Path, work: Path, corpus: Path, tok: Path, docs: int,
                      workers: int, rounds: int) -> dict:
    env = preprocess_env(work)
    mlm_out, ours_out = work / f"mlm-w{workers}", work / f"mdtk-w{workers}"
    mlm_cmd = megatron_preprocess_cmd(checkout, [str(corpus)], tok, str(mlm_out), workers,
                                      append_eod=True, log_interval=max(1, docs // 20))
    ours_cmd = [MDTK, "data", "preprocess", str(corpus), "--tokenizer", str(tok),
                "--output-prefix", str(ours_out), "--append-eod", "--workers", str(workers),
                "--quiet"]
    runs: dict[str, list[dict]] = {"megatron-lm": [], "mdtk": []}
    for _ in range(rounds):
        for name, cmd in (("megatron-lm", mlm_cmd), ("mdtk", ours_cmd)):
            r = measure(cmd, env=env if name == "megatron-lm" else None, keep_output=True)
            parse = megatron_docs_per_s if name == "megatron-lm" else mdtk_docs_per_s
            r["docs_per_s"] = parse(r.pop("output"))
            runs[name].append(r)
        same = all(filecmp.cmp(f"{mlm_out}_text_document.{e}", f"{ours_out}_text_document.{e}",
                               shallow=False) for e in ("bin", "idx"))
        if not same:
            raise SystemExit(f"outputs differ at {workers} workers: {mlm_out} vs {ours_out}")
    return summarise(runs)


def summarise(runs: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for name, rs in runs.items():
        out[name] = {k: {"median": statistics.median(r[k] for r in rs),
                         "spread": [min(r[k] for r in rs), max(r[k] for r in rs)]}
                     for k in ("docs_per_s", "seconds", "user", "peak_rss")}
    m, o = out["megatron-lm"], out["mdtk"]
    out["docs_per_s_ratio"] = o["docs_per_s"]["median"] / m["docs_per_s"]["median"]
    out["wall_ratio"] = m["seconds"]["median"] / o["seconds"]["median"]
    out["identical"] = True
    return out


def make_prefixes(folder: Path, count: int, tok: Path, corpus: Path) -> list[str]:
    """``count`` small indexed datasets (about 40 documents each) cut from the corpus."""
    from toolkit.train.data.indexed_format import IndexWriter, read_index
    from toolkit.train.data.preprocess import Encoder, TokenizeSpec
    from toolkit.train.data.readers import Batch

    prefixes = [str(folder / f"p{i:05d}") for i in range(count)]
    if all(Path(f"{p}.idx").is_file() for p in prefixes):
        return prefixes
    folder.mkdir(parents=True, exist_ok=True)
    enc = Encoder(TokenizeSpec(str(tok), ("text",), append_eod=True))
    with open(corpus, "rb") as f:
        for p in prefixes:
            lines = []
            while len(lines) < 40:
                lines.append(f.readline() or (f.seek(0), f.readline())[1])
            (result,) = enc(Batch(str(corpus), 1, lines=lines)).values()
            w = IndexWriter(p, enc.dtype)
            w.add(*result)
            w.finalize()
    read_index(prefixes[-1])
    return prefixes


def blend_startup(work: Path, prefixes: list[str], tok: Path) -> dict:
    """First and second start of a 1-step run over the blend (one rank, CPU)."""
    import random

    from toolkit.demo import make_tiny_checkpoint

    vocab = len(json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"]) + 16
    model = make_tiny_checkpoint(work / "tiny-model", overrides={"vocab_size": vocab})
    rng = random.Random(0)
    weights = [round(rng.uniform(0.1, 1.0), 3) for _ in prefixes]
    cfg = work / "blend.yaml"
    run = work / "blend-run"
    cfg.write_text(json.dumps({
        "output_dir": str(run), "model": {"config": str(model / "config.json"),
                                          "tokenizer": str(tok)},
        "data": {"mode": "pretrain", "sources": prefixes, "weights": weights,
                 "validation_split": 0.0, "cache_dir": str(work / "blend-cache")},
        "train": {"steps": 1, "micro_batch": 1, "global_batch": 8, "seq_len": 64,
                  "precision": "fp32"},
        "checkpoint": {"interval": 0, "resume": "none"}}))
    shutil.rmtree(work / "blend-cache", ignore_errors=True)
    out = {}
    for start in ("first", "second"):
        shutil.rmtree(run, ignore_errors=True)
        r = measure([MDTK, "launch", "-n", "1", "--", "train", str(cfg)], keep_output=True)
        log = r.pop("output")
        found = re.search(r"data ready in ([\d.]+) s", log)
        r["data_s"] = float(found.group(1)) if found else None
        out[start] = r
    return out


GPU_TRAIN = {"steps": 30, "micro_batch": 4, "global_batch": 16, "seq_len": 256,
             "precision": "bf16"}


def gpu_train(work: Path, out: Path) -> dict:
    """Part 3: ``mdtk train`` on a 0.25 / 0.75 blend of two indexed prefixes, one rank."""
    from toolkit import bundled
    from toolkit.demo import make_tiny_checkpoint
    from toolkit.train.data.preprocess import TokenizeSpec, preprocess

    hf = make_tiny_checkpoint(work / "gpu-hf", overrides={"vocab_size": 1024})
    lines = (bundled.path(bundled.DATA) / "pretrain.jsonl").read_text().splitlines(True)
    prefixes = []
    for i, part in enumerate((lines[: len(lines) // 2], lines[len(lines) // 2:])):
        (work / f"gpu-corpus{i}.jsonl").write_text("".join(part))
        s = preprocess([str(work / f"gpu-corpus{i}.jsonl")], TokenizeSpec(str(hf), append_eod=True),
                       str(work / f"gpu-src{i}"), progress=False)
        prefixes.append(s.outputs["text"])
    run = work / "gpu-run"
    cfg = work / "gpu-train.json"
    cfg.write_text(json.dumps({
        "output_dir": str(run), "model": {"path": str(hf)},
        "data": {"mode": "pretrain", "sources": prefixes, "weights": [0.25, 0.75],
                 "validation_split": 0.0, "cache_dir": str(work / "gpu-cache")},
        "optim": {"lr": 1e-3, "warmup_steps": 2}, "train": GPU_TRAIN,
        "checkpoint": {"interval": 0, "resume": "none"}, "logging": {"interval": 1}}))
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(work / "gpu-cache", ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                           "-m", "toolkit.cli", "train", str(cfg)], env=env,
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    log = done.stdout + done.stderr
    if done.returncode:
        raise SystemExit(f"mdtk train failed:\n{log[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    by_source = rows[-1]["tokens_by_source"]
    first = next(k for k in by_source if k.endswith("src0_text_document"))
    found = re.search(r"data ready in ([\d.]+) s", log)
    result = {"train": GPU_TRAIN, "weights": [0.25, 0.75], "wall_s": wall,
              "data_s": float(found.group(1)) if found else None,
              "losses": [r["loss"] for r in rows],
              "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[2:]),
              "share_first_source": by_source[first] / sum(by_source.values()),
              "tokens_by_source": by_source}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", type=Path, nargs="?",
                   help="Megatron-LM source checkout (core_v0.16.1); not for --gpu-train")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "bench_data")
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefixes", type=int, default=1000)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--gpu-train", type=Path, metavar="OUT",
                   help="only part 3 (one GPU): mdtk train over an indexed blend; JSON to OUT")
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    if a.gpu_train:
        gpu_train(a.work, a.gpu_train)
        return 0
    if a.checkout is None:
        p.error("give a Megatron-LM checkout (or --gpu-train OUT)")
    corpus = a.work / f"corpus-{a.mb}mb.jsonl"
    t0 = time.perf_counter()
    docs = make_corpus(corpus, a.mb)
    tok = make_tokenizer(a.work / f"tokenizer-{a.vocab}", corpus, a.vocab)
    print(f"corpus {corpus} ({corpus.stat().st_size / 2**20:.0f} MB, {docs:,} documents), "
          f"tokenizer {tok} (ready in {time.perf_counter() - t0:.0f} s)")
    results: dict = {"mb": corpus.stat().st_size / 2**20, "documents": docs, "preprocess": {}}
    for w in a.workers:
        r = preprocess_rounds(a.checkout.resolve(), a.work, corpus, tok, docs, w, a.rounds)
        results["preprocess"][w] = r
        m, o = r["megatron-lm"], r["mdtk"]
        print(f"workers {w}: docs/s Megatron-LM {m['docs_per_s']['median']:,.0f} "
              f"({m['docs_per_s']['spread'][0]:,.0f}-{m['docs_per_s']['spread'][1]:,.0f}), "
              f"mdtk {o['docs_per_s']['median']:,.0f} ({o['docs_per_s']['spread'][0]:,.0f}-"
              f"{o['docs_per_s']['spread'][1]:,.0f}): x{r['docs_per_s_ratio']:.2f}; wall "
              f"{m['seconds']['median']:.1f} s vs {o['seconds']['median']:.1f} s "
              f"(x{r['wall_ratio']:.2f}); peak RSS {m['peak_rss']['median'] / 2**20:,.0f} MiB vs "
              f"{o['peak_rss']['median'] / 2**20:,.0f} MiB; outputs byte-identical")
    if a.prefixes:
        prefixes = make_prefixes(a.work / f"prefixes-{a.prefixes}", a.prefixes, tok, corpus)
        r = blend_startup(a.work, prefixes, tok)
        results["blend"] = {"prefixes": a.prefixes, **r}
        for start in ("first", "second"):
            print(f"{a.prefixes}-prefix blend, {start} start: mdtk train (1 step) "
                  f"{r[start]['seconds']:.1f} s wall, data phase {r[start]['data_s']} s")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
