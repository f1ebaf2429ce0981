"""Where an RL step's time goes: rollout (generation on the training ranks + rewards), the
reference's and the old policy's log-probabilities, and the update (forward, backward, optimizer),
for the bundled example (bundled:examples/grpo_tiny.yaml) on the demo's tiny Llama (random
weights), one rank, in one process.

The settings alternate, ``--rounds`` times each: the example as shipped (beta 0, one update per
generation batch: no reference, no old log-probabilities) and the same with ``grpo.beta=0.04``
and ``grpo.num_iterations=2`` (a reference model; old log-probabilities once per batch, which
then serves two steps). Prints, per setting, the median seconds per step of each phase with its
spread (min-max over rounds) and its share of the step; the example's mean reward per step
(median over rounds) as a trend, written as an SVG plot with ``--plot``.

    python scripts/bench_grpo.py [--rounds 3] [--steps 60] [--json OUT] [--plot docs/x.svg]
                                 [--device cpu|cuda] [--settings example,kl_it2,vllm]
                                 [--hidden 128 --head-dim 32]

``--settings ...,vllm`` adds the example with its rollouts from a colocated vLLM engine
(``grpo.engine: vllm``; its ``sync`` phase: the live weights streamed into vLLM); vLLM's CPU
attention takes head sizes of 32 and up, so compare with ``--hidden 128 --head-dim 32``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"example": [], "kl_it2": ["grpo.beta=0.04", "grpo.num_iterations=2"],
            # the example with its rollouts from vLLM colocated on the rank (needs vllm)
            "vllm": ["grpo.engine=vllm"]}


def _timed(table: dict[str, float], name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name] += time.perf_counter() - start
    return wrapper


def one_run(model: Path, out: Path, steps: int, extra: list[str]) -> dict:
    """The example for ``steps`` steps; seconds per phase summed over the run, rewards."""
    from toolkit.train import trainer
    from toolkit.train.config import load_config
    from toolkit.train.objectives.grpo import objective, rollouts

    spent: dict[str, float] = defaultdict(float)
    saved = (rollouts.Generated.batch, objective.GrpoObjective._prepare, trainer.run_step)
    rollouts.Generated.batch = _timed(spent, "rollout", saved[0])
    objective.GrpoObjective._prepare = _timed(spent, "prepare", saved[1])
    trainer.run_step = _timed(spent, "update", saved[2])
    vllm = "grpo.engine=vllm" in extra
    if vllm:
        from toolkit.infer.vllm_engine import VllmSampler

        sync = VllmSampler.sync
        VllmSampler.sync = _timed(spent, "sync", sync)
    try:
        cfg = load_config("bundled:examples/grpo_tiny.yaml", [
            f"model.path={model}", f"model.tokenizer={model}", f"output_dir={out}",
            "checkpoint.resume=none", f"train.steps={steps}", *extra])
        start = time.perf_counter()
        result = trainer.run(cfg)
        total = time.perf_counter() - start
    finally:
        rollouts.Generated.batch, objective.GrpoObjective._prepare, trainer.run_step = saved
        if vllm:
            VllmSampler.sync = sync
    phases = {"sync": spent["sync"], "rollout": spent["rollout"] - spent["sync"],
              "logps": spent["prepare"] - spent["rollout"], "update": spent["update"]}
    return {"per_step": {k: v / steps for k, v in phases.items()},
            "run_s": total, "rewards": [m["reward"] for m in result.metrics]}


def svg_plot(values: list[float], path: Path, title: str) -> None:
    """A dependency-free line plot of ``values`` (the mean reward per step)."""
    w, h, pad = 480, 200, 30
    top = max(max(values), 1e-9)
    pts = " ".join(f"{pad + i * (w - 2 * pad) / max(len(values) - 1, 1):.1f},"
                   f"{h - pad - v / top * (h - 2 * pad):.1f}" for i, v in enumerate(values))
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">'
        f'<rect width="{w}" height="{h}" fill="white"/>'
        f'<text x="{pad}" y="18" font-size="12">{title}</text>'
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>'
        f'<text x="2" y="{pad + 4}" font-size="10">{top:.2f}</text>'
        f'<text x="2" y="{h - pad}" font-size="10">0</text>'
        f'<text x="{w - pad - 40}" y="{h - 8}" font-size="10">step {len(values)}</text>'
        f'<polyline fill="none" stroke="steelblue" stroke-width="2" points="{pts}"/></svg>\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="write the example's reward trend (SVG)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="default: cuda when a GPU is visible, else cpu")
    parser.add_argument("--settings", default="example,kl_it2",
                        help=f"comma list of {', '.join(SETTINGS)} (vllm: needs the vllm package "
                             "and a head size vLLM's attention takes, e.g. --head-dim 32)")
    parser.add_argument("--hidden", type=int, help="the tiny Llama's hidden size (default 64)")
    parser.add_argument("--head-dim", type=int, help="its head size (default 16)")
    args = parser.parse_args()
    settings = {n: SETTINGS[n] for n in args.settings.split(",")}
    if args.device:
        os.environ["MDTK_DEVICE"] = args.device
    sys.path.insert(0, str(ROOT))
    from toolkit.demo import make_tiny_checkpoint

    skipped = {}
    if "vllm" in settings:
        from toolkit.infer.vllm_engine import vllm_missing

        if (problem := vllm_missing()) is not None:
            print(f"vllm: skipped: {problem}")
            skipped["vllm"] = problem
            del settings["vllm"]
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    shape = {k: v for k, v in (("hidden_size", args.hidden), ("head_dim", args.head_dim)) if v}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "tiny-llama", overrides=shape)
        for r in range(args.rounds):
            for name, extra in settings.items():  # alternating
                runs[name].append(one_run(model, Path(tmp) / f"{name}_{r}", args.steps, extra))
    summary = {}
    for name, rs in runs.items():
        step = [sum(x["per_step"].values()) for x in rs]
        row = {}
        for phase in ("sync", "rollout", "logps", "update"):
            vals = [x["per_step"][phase] for x in rs]
            row[phase] = {"median_s": statistics.median(vals), "min_s": min(vals),
                          "max_s": max(vals),
                          "share": statistics.median(v / s for v, s in zip(vals, step,
                                                                           strict=True))}
        summary[name] = row
        print(f"{name}: " + ", ".join(f"{p} {v['median_s'] * 1e3:.0f} ms "
                                      f"({v['min_s'] * 1e3:.0f}-{v['max_s'] * 1e3:.0f}; "
                                      f"{v['share']:.0%})" for p, v in row.items()))
    first_setting = next(iter(runs))
    trend = [statistics.median(r["rewards"][i] for r in runs[first_setting])
             for i in range(args.steps)]
    first, last = sum(trend[:5]) / 5, sum(trend[-5:]) / 5
    print(f"{first_setting} reward (median of {args.rounds} runs): first 5 steps {first:.3f}, "
          f"last 5 {last:.3f}")
    if args.plot:
        svg_plot(trend, args.plot, "bundled:examples/grpo_tiny.yaml: mean reward per step")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "trend": trend,
                                         "skipped": skipped}, indent=1))


if __name__ == "__main__":
    main()
