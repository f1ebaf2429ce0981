"""Megatron-LM's own trainer and ``mdtk train`` give the same losses on the same indexed data.

The same tiny Llama (random weights, transformers), converted by mdtk to torch_dist for
Megatron-LM, trains for 10 steps on the same data, layout, seed and batch: once with Megatron-LM's
``pretrain_gpt.py`` (its ``pretrain()``: arguments, DDP, optimizer, data loader, training loop)
and once with ``mdtk train``, each on 2 CPU gloo ranks, at dp2 and at tp2, fp32. The data: a
corpus split in two JSON Lines files, each made an indexed dataset by Megatron-LM's
``tools/preprocess_data.py`` (and by ``mdtk data preprocess``, which must write the same bytes),
blended 0.3 / 0.7. Passes when the first 10 losses agree within ``--tol`` relative; prints the
tokens/s of both side by side.

    PYTHONPATH=$PWD .venv/bin/python scripts/check_megatron_lm_training.py MEGATRON_LM_CHECKOUT \\
        [--work DIR] [--tol 1e-4] [--layouts dp2 tp2]

What makes the two runs comparable (each side's flags are printed):
- model: mdtk's torch_dist conversion of the HF folder, loaded with ``--load DIR --finetune
  --no-load-optim --no-load-rng`` (iteration 0, fresh optimizer); the model flags of a standard
  Llama launch (``check_megatron_lm.model_flags``), dropout 0; the vocab is the model's (1024)
  and not padded (``--make-vocab-size-divisible-by 512``: Megatron-LM pads the tokenizer's 771
  tokens to 1024 at tp 1 and 2), so neither side has padded logits;
- data: ``--data-path 0.3 A 0.7 B --split 100,0,0`` = ``data.sources [A, B] data.weights [0.3,
  0.7] data.validation_split 0``; ``--seed`` = ``train.seed`` (GPTDataset's shuffle);
  ``--no-create-attention-mask-in-dataloader`` (the causal mask is built in the model, as mdtk);
  the run stays inside one epoch of each prefix, where mdtk reads Megatron-LM's samples;
- batch: micro 2, global 8, seq_len 128; fp32 (no --bf16);
- optimizer: Adam, lr 1e-3 constant (``--lr-decay-style constant``, no warm-up, ``optim.decay
  constant``), betas 0.9 / 0.95, eps 1e-8, weight decay 0 (Megatron-LM exempts biases and
  norms from decay, DeepSpeed does not: with 0 there is nothing to exempt), gradient clipping
  at norm 1.0 on both (the grad norm of this model starts near 3: every step clips, so both
  trainers' global grad norms are compared too);
- Megatron-LM on CPU: the flags of ``check_megatron_lm.CPU_FLAGS`` and its shims, plus
  ``initialize_megatron(allow_no_cuda=True)`` (``pretrain()`` asserts CUDA otherwise), no JIT
  warm-up (``set_jit_fusion_options``: it compiles fused CUDA kernels the flags turn off) and
  megatron-core's gradient clipping run with ``Tensor.type()`` answering the CUDA type name
  (``clip_grad_by_total_norm_fp32`` asserts it). Megatron-LM's losses are its ``train_step``'s
  own (token-weighted over the global batch), recorded per iteration: its log line averages the
  iterations since the last print, and at ``--log-interval 1`` still merges iterations 1 and 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_megatron_lm as loader_check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1024
STEPS, MICRO, GLOBAL, SEQ, SEED, LR = 10, 2, 8, 128, 1234, 1e-3
WEIGHTS = (0.3, 0.7)
LAYOUTS = {"dp2": {"tp": 1}, "tp2": {"tp": 2}}
NPROC = 2

RUN_FLAGS = ["--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL),
             "--seq-length", str(SEQ), "--train-iters", str(STEPS), "--seed", str(SEED),
             "--optimizer", "adam", "--lr", str(LR), "--min-lr", str(LR),
             "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--weight-decay", "0.0",
             "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
             "--clip-grad", "1.0", "--split", "100,0,0", "--num-workers", "0",
             "--no-create-attention-mask-in-dataloader", "--eval-iters", "0",
             "--eval-interval", "1000000", "--log-interval", "1", "--log-throughput",
             "--make-vocab-size-divisible-by", "512", "--finetune", "--no-load-optim",
             "--no-load-rng"]


# -- Megatron-LM's preprocess_data.py ----------------------------------------------------------
STANDINS = {
    "six.py": "PY2, PY3 = False, True\n",
    "sitecustomize.py": (
        "import sys, types\n"
        "name = 'megatron.core.transformer.custom_layers.batch_invariant_kernels'\n"
        "m = types.ModuleType(name)\n"
        "def enable_batch_invariant_mode(*a, **k):\n"
        "    raise RuntimeError('batch-invariant mode needs triton')\n"
        "m.enable_batch_invariant_mode = enable_batch_invariant_mode\n"
        "sys.modules[name] = m\n"),
}


def preprocess_env(work: Path) -> dict[str, str]:
    """The environment Megatron-LM's tools start in here: ``six`` (imported by its BERT
    tokenizer for PY2/PY3 only) and the triton-only batch-invariant kernels module (imported
    unconditionally by megatron/training/initialize) as stand-ins on PYTHONPATH."""
    shims = work / "mlm-standins"
    shims.mkdir(parents=True, exist_ok=True)
    for name, text in STANDINS.items():
        (shims / name).write_text(text)
    return {**os.environ, "PYTHONPATH": str(shims), "PYTHONWARNINGS": "ignore"}


def megatron_preprocess_cmd(checkout: Path, inputs: list[str], tokenizer: Path, prefix: str,
                            workers: int, *, append_eod: bool = True,
                            log_interval: int = 1000) -> list[str]:
    """Megatron-LM's preprocess_data.py for one input file and a local HF tokenizer folder."""
    if len(inputs) != 1:
        raise ValueError("preprocess_data.py reads one --input")
    return [sys.executable, str(checkout / "tools" / "preprocess_data.py"), "--input", inputs[0],
            "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tokenizer), "--workers", str(workers),
            "--log-interval", str(log_interval), *(["--append-eod"] if append_eod else [])]


def make_data(checkout: Path, work: Path, tokenizer: Path) -> list[str]:
    """The bundled pretraining corpus in two halves, each preprocessed by Megatron-LM and by
    mdtk (which must write the same bytes). Returns Megatron-LM's prefixes."""
    import filecmp

    from toolkit import bundled
    from toolkit.train.data.preprocess import TokenizeSpec, preprocess

    lines = (bundled.path(bundled.DATA) / "pretrain.jsonl").read_text().splitlines(True)
    prefixes = []
    for i, part in enumerate((lines[: len(lines) // 2], lines[len(lines) // 2:])):
        src = work / f"corpus{i}.jsonl"
        src.write_text("".join(part))
        mlm, ours = str(work / f"mlm{i}"), str(work / f"mdtk{i}")
        done = subprocess.run(megatron_preprocess_cmd(checkout, [str(src)], tokenizer, mlm, 1),
                              env=preprocess_env(work), capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"preprocess_data.py failed:\n{done.stderr[-3000:]}")
        preprocess([str(src)], TokenizeSpec(str(tokenizer), append_eod=True), ours,
                   progress=False)
        for ext in ("bin", "idx"):
            a, b = f"{mlm}_text_document.{ext}", f"{ours}_text_document.{ext}"
            if not filecmp.cmp(a, b, shallow=False):
                raise RuntimeError(f"mdtk data preprocess wrote other bytes than Megatron-LM: "
                                   f"{b} != {a}")
        prefixes.append(f"{mlm}_text_document")
    return prefixes


# -- the two trainers --------------------------------------------------------------------------
@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    flags: list[str] = field(default_factory=list)
    error: str | None = None


def megatron_flags(config: dict, hf: Path, ckpt: Path, prefixes: list[str], tp: int,
                   cache: Path) -> list[str]:
    cpu = [f for flags in loader_check.CPU_FLAGS.values() for f in flags]
    blend = [x for w, p in zip(WEIGHTS, prefixes, strict=True) for x in (str(w), p)]
    model = loader_check.model_flags(config, hf)
    at = model.index("--seq-length")
    model = model[:at] + model[at + 2:]  # the run's own sequence length is in RUN_FLAGS
    return [*model, *cpu, *RUN_FLAGS,
            "--tensor-model-parallel-size", str(tp), "--data-path", *blend,
            "--data-cache-path", str(cache), "--load", str(ckpt)]


def run_megatron(checkout: Path, work: Path, name: str, flags: list[str]) -> Run:
    """pretrain_gpt.py's main on NPROC gloo ranks; the logged losses and throughput."""
    from toolkit.runtime.ports import free_port

    spec, out = work / f"mlm-{name}.json", work / f"mlm-{name}-steps.json"
    out.unlink(missing_ok=True)
    spec.write_text(json.dumps({"flags": flags, "out": str(out)}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}",
           f"--master-port={free_port()}", __file__, str(checkout), "--worker", str(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    log = done.stdout + done.stderr
    (work / f"log-mlm-{name}.txt").write_text(log)
    if done.returncode:
        return Run(flags=flags, error=loader_check.first_traceback(log))
    steps = json.loads(out.read_text())
    seconds = steps["seconds"][1:] or steps["seconds"]
    return Run(steps["losses"], GLOBAL * SEQ / statistics.median(seconds), flags)


def worker(checkout: Path, spec: dict[str, Any]) -> None:
    """One Megatron-LM rank: pretrain_gpt.py's __main__ with the CPU shims."""
    import runpy
    from functools import partial

    import torch

    torch.set_num_threads(1)
    loader_check.megatron_lm_shims(checkout)
    sys.path.insert(0, str(checkout))  # pretrain_gpt imports gpt_builders, model_provider
    import megatron.training.training as training

    # pretrain() calls initialize_megatron without allow_no_cuda (it asserts CUDA), then warms
    # up TorchScript/compiled fusions that CPU runs have turned off.
    training.initialize_megatron = partial(training.initialize_megatron, allow_no_cuda=True)
    training.set_jit_fusion_options = lambda *a, **k: None
    _clip_on_cpu(torch)
    steps = _record_train_steps(training)
    sys.argv = [str(checkout / "pretrain_gpt.py"), *spec["flags"]]
    runpy.run_path(str(checkout / "pretrain_gpt.py"), run_name="__main__")
    if torch.distributed.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(steps))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _clip_on_cpu(torch) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` asserts each gradient's type string is
    ``torch.cuda.FloatTensor``; on CPU it is ``torch.FloatTensor``. Run megatron-core's own
    function with ``Tensor.type()`` answering the CUDA name for fp32 tensors meanwhile."""
    from megatron.core.optimizer import optimizer as mc_optimizer

    original = mc_optimizer.clip_grad_by_total_norm_fp32
    real_type = torch.Tensor.type

    def cuda_name(self, *args, **kwargs):
        if not args and not kwargs and self.dtype == torch.float32:
            return "torch.cuda.FloatTensor"
        return real_type(self, *args, **kwargs)

    def clip(*args, **kwargs):
        torch.Tensor.type = cuda_name
        try:
            return original(*args, **kwargs)
        finally:
            torch.Tensor.type = real_type

    mc_optimizer.clip_grad_by_total_norm_fp32 = clip


def _record_train_steps(training) -> dict[str, list[float]]:
    """Megatron-LM's own per-iteration loss (``train_step``'s token-weighted mean over the
    global batch) and wall time, as its training loop computes them: its log line averages
    the iterations since the last one it printed, which at log interval 1 still merges the
    first two."""
    import time

    steps: dict[str, list[float]] = {"losses": [], "seconds": []}
    original = training.train_step

    def recording(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        steps["seconds"].append(time.perf_counter() - t0)
        if out[0]:  # the last pipeline stage's reduced losses
            steps["losses"].append(float(out[0]["lm loss"]))
        return out

    training.train_step = recording
    return steps


def mdtk_config(hf: Path, prefixes: list[str], tp: int, out: Path, cache: Path) -> dict:
    return {
        "output_dir": str(out), "model": {"path": str(hf)},
        "parallel": {"tp": tp},
        "deepspeed": {"zero_stage": 1},
        "data": {"mode": "pretrain", "sources": prefixes, "weights": list(WEIGHTS),
                 "validation_split": 0.0, "cache_dir": str(cache)},
        "optim": {"lr": LR, "min_lr": LR, "decay": "constant", "warmup_steps": 0,
                  "weight_decay": 0.0, "clip_grad": 1.0, "betas": [0.9, 0.95], "eps": 1e-8},
        "train": {"steps": STEPS, "micro_batch": MICRO, "global_batch": GLOBAL, "seq_len": SEQ,
                  "precision": "fp32", "seed": SEED, "eval_interval": 0},
        "checkpoint": {"interval": 0, "resume": "none"},
        "logging": {"interval": 1},
    }


def run_mdtk(work: Path, name: str, config: dict) -> Run:
    from toolkit.runtime.ports import free_port

    cfg = work / f"mdtk-{name}.json"
    cfg.write_text(json.dumps(config))
    shutil.rmtree(config["output_dir"], ignore_errors=True)  # metrics.jsonl appends
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}",
           f"--master-port={free_port()}", "-m", "toolkit.cli", "train", str(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    log = done.stdout + done.stderr
    (work / f"log-mdtk-{name}.txt").write_text(log)
    flags = [f"{k}={v}" for k, v in _flat(config)]
    if done.returncode:
        return Run(flags=flags, error=log[-3000:])
    rows = [json.loads(x) for x in (Path(config["output_dir"]) / "metrics.jsonl").read_text()
            .splitlines()]
    tps = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else None
    return Run([r["loss"] for r in rows], tps, flags)


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


# -- the check ---------------------------------------------------------------------------------
def check(checkout: Path, work: Path, layouts: list[str]) -> dict[str, tuple[Run, Run]]:
    from toolkit.convert import convert
    from toolkit.demo import make_tiny_checkpoint
    from toolkit.parallel.layout import ParallelLayout

    hf = make_tiny_checkpoint(work / "hf", overrides={"vocab_size": VOCAB})
    config = json.loads((hf / "config.json").read_text())
    prefixes = make_data(checkout, work, hf)
    ckpt = work / "torch_dist"
    convert(hf, ckpt, "mcore", ParallelLayout(), overwrite=True, progress=False)
    out = {}
    for name in layouts:
        tp = LAYOUTS[name]["tp"]
        theirs = run_megatron(checkout, work, name, megatron_flags(
            config, hf, ckpt, prefixes, tp, work / f"mlm-cache-{name}"))
        ours = run_mdtk(work, name, mdtk_config(hf, prefixes, tp, work / f"mdtk-run-{name}",
                                                work / f"mdtk-cache-{name}"))
        out[name] = (theirs, ours)
    return out


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def report(results: dict[str, tuple[Run, Run]], checkout: Path, tol: float) -> tuple[str, bool]:
    lines = [f"Megatron-LM: {loader_check.describe_checkout(checkout)}"]
    ok = True
    for name, (theirs, ours) in results.items():
        err = theirs.error or ours.error
        good = (not err and len(theirs.losses) == STEPS == len(ours.losses)
                and max_rel_diff(theirs.losses, ours.losses) <= tol)
        ok &= good
        diff = "-" if err or len(theirs.losses) != len(ours.losses) else \
            f"{max_rel_diff(theirs.losses, ours.losses):.2e}"
        lines.append(f"{'PASS' if good else 'FAIL'} {name}: first {STEPS} losses max rel diff "
                     f"{diff} (tol {tol:g}); tokens/s Megatron-LM {_num(theirs.tokens_per_s)} "
                     f"mdtk {_num(ours.tokens_per_s)}")
        lines.append("  Megatron-LM: " + " ".join(f"{x:.6f}" for x in theirs.losses))
        lines.append("  mdtk:        " + " ".join(f"{x:.6f}" for x in ours.losses))
        if err:
            lines.append("  " + err.replace("\n", "\n  "))
    first = next(iter(results.values()))
    lines.append("Megatron-LM flags (dp2): " + " ".join(first[0].flags))
    lines.append("mdtk config (dp2): " + " ".join(first[1].flags))
    return "\n".join(lines), ok


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", type=Path, help="a Megatron-LM source checkout (core_v0.16.1)")
    p.add_argument("--work", type=Path, help="folder for the model, data, runs and logs "
                   "(default: a temporary folder, removed afterwards)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative loss difference")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    checkout = a.checkout.resolve()
    if a.worker:
        worker(checkout, json.loads(a.worker.read_text()))
        return 0
    if not (checkout / "pretrain_gpt.py").is_file():
        p.error(f"{checkout} is not a Megatron-LM checkout (no pretrain_gpt.py)")
    with tempfile.TemporaryDirectory(prefix="mdtk-mlm-train-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        text, ok = report(check(checkout, work, a.layouts), checkout, a.tol)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
