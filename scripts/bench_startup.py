"""Start-up time of ``mdtk`` commands, as ratios to ``python -c "import torch"``.

Each command runs as a fresh process, alternating with the baseline (baseline, command, baseline,
command, ...) so that both see the same machine load; the figure is the median of each and their
ratio, with the spread (min-max) of both. One unmeasured warm-up run of each fills the page cache.
Commands on a tiny model (2 layers, built here with transformers, not timed): ``mdtk --help``,
``mdtk inspect``, ``mdtk estimate --model llama-3.1-8b``, ``mdtk convert --to mcore`` and
``mdtk convert --to hf`` of that model's torch_dist checkpoint (written once, not timed).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_startup.py [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BASELINE = [sys.executable, "-c", "import torch"]


def mdtk() -> list[str]:
    """The ``mdtk`` entry point of this interpreter's environment (or ``-m toolkit.cli``)."""
    script = Path(sys.executable).parent / "mdtk"
    return [sys.executable, str(script)] if script.is_file() else [sys.executable, "-m",
                                                                    "toolkit.cli"]


def make_tiny(folder: Path) -> Path:
    """A 2-layer random Llama saved by transformers (safetensors + config.json)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def run_once(argv: list[str], before: Callable[[], None] | None = None) -> float:
    """Seconds from start to exit of one process (``before`` runs untimed first)."""
    if before is not None:
        before()
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return took


def measure(argv: list[str], runs: int, before: Callable[[], None] | None = None) -> dict:
    """Alternate baseline and ``argv`` ``runs`` times; medians, spreads and their ratio."""
    run_once(BASELINE)
    run_once(argv, before)
    base, subject = [], []
    for _ in range(runs):
        base.append(run_once(BASELINE))
        subject.append(run_once(argv, before))
    med_b, med_s = statistics.median(base), statistics.median(subject)
    return {"median_s": round(med_s, 3), "spread_s": [round(min(subject), 3),
                                                      round(max(subject), 3)],
            "baseline_median_s": round(med_b, 3),
            "baseline_spread_s": [round(min(base), 3), round(max(base), 3)],
            "ratio": round(med_s / med_b, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs of each (and the baseline)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--only", nargs="*", help="subset of: help inspect estimate convert "
                    "convert-hf")
    args = ap.parse_args()
    cli = mdtk()
    with tempfile.TemporaryDirectory(prefix="mdtk-startup-") as tmp:
        tiny = make_tiny(Path(tmp) / "tiny")
        out, back, mcore = Path(tmp) / "out", Path(tmp) / "back", Path(tmp) / "mcore"
        run_once([*cli, "convert", str(tiny), str(mcore), "--to", "mcore", "-q"])
        subjects: dict[str, tuple[list[str], Callable[[], None] | None]] = {
            "help": ([*cli, "--help"], None),
            "inspect": ([*cli, "inspect", str(tiny)], None),
            "estimate": ([*cli, "estimate", "--model", "llama-3.1-8b"], None),
            "convert": ([*cli, "convert", str(tiny), str(out), "--to", "mcore", "-q"],
                        lambda: shutil.rmtree(out, ignore_errors=True)),
            "convert-hf": ([*cli, "convert", str(mcore), str(back), "--to", "hf", "-q"],
                           lambda: shutil.rmtree(back, ignore_errors=True)),
        }
        results = {}
        print(f"{'command':<10} {'median s':>9} {'spread s':>13} {'torch s':>8} "
              f"{'spread s':>13} {'ratio':>6}")
        for name, (argv, before) in subjects.items():
            if args.only and name not in args.only:
                continue
            r = measure(argv, args.runs, before)
            results[name] = r
            print(f"{name:<10} {r['median_s']:>9.2f} {r['spread_s'][0]:>6.2f}-"
                  f"{r['spread_s'][1]:<6.2f} {r['baseline_median_s']:>8.2f} "
                  f"{r['baseline_spread_s'][0]:>6.2f}-{r['baseline_spread_s'][1]:<6.2f} "
                  f"{r['ratio']:>6.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"runs": args.runs, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
