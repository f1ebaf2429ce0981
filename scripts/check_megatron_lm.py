"""Megatron-LM itself loads mdtk's Megatron checkpoints and reproduces transformers' logits.

mdtk writes Megatron checkpoints (legacy ``mp_rank_XX`` and ``torch_dist``) that should load in
Megatron-LM as its own, with a plain ``--load``. This script checks that with Megatron-LM's code,
not mdtk's: a tiny random Llama (transformers) is converted by mdtk at tp=2 to both formats, then
2 gloo ranks run what ``pretrain_gpt.py --load DIR`` runs before training (``initialize_megatron``
with pretrain_gpt's defaults, ``setup_model_and_optimizer`` with pretrain_gpt's model provider,
which calls ``megatron.training.checkpointing.load_checkpoint``), a forward pass on fixed tokens,
and the tp-gathered logits are compared with transformers' in fp32.

Each format is loaded twice: with the model given by flags (a standard Llama launch, the flags
Megatron-LM's own fixture run used) and with ``--use-checkpoint-args`` (the model from mdtk's
``args``). Megatron-LM's ``megatron/training`` comes from the checkout given; ``megatron.core``
from the installed megatron-core (the checkout is appended to ``sys.path``, so the installed one
wins; the worker asserts it). Use a checkout whose tag matches the installed megatron-core.

    PYTHONPATH=$PWD .venv/bin/python scripts/check_megatron_lm.py MEGATRON_LM_CHECKOUT \
        [--work DIR] [--tol 1e-4]

Prints one line per run (format, flags, logits max abs diff, PASS/FAIL) and exits 1 on failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The tiny model: the bundled tiny Llama with a vocab that tp=2 x 128 does not divide (so
#: Megatron-LM's vocab padding is exercised) and a non-default RoPE base (so a missing
#: ``rotary_base`` would show in the logits).
MODEL_OVERRIDES = {"vocab_size": 300, "rope_theta": 500000.0}
TP = 2
TOKENS_SHAPE = (2, 24)

#: Flags every run needs on CPU, each with why (Megatron-LM's defaults assume CUDA, TE and apex).
CPU_FLAGS: dict[str, list[str]] = {
    "no NCCL on CPU": ["--distributed-backend", "gloo"],
    "Transformer Engine needs CUDA: megatron-core's local layer spec": ["--transformer-impl",
                                                                         "local"],
    "weights built on the host, not on a GPU": ["--use-cpu-initialization"],
    "fused weight-gradient accumulation is an apex/CUDA kernel": [
        "--no-gradient-accumulation-fusion"],
    "fused masked softmax is a CUDA kernel": ["--no-masked-softmax-fusion"],
    "fused bias+SwiGLU is a TorchScript/CUDA fusion": ["--no-bias-swiglu-fusion"],
    "fused bias+dropout is a TorchScript/CUDA fusion": ["--no-bias-dropout-fusion"],
    "fused RoPE is a TE/apex CUDA kernel": ["--no-rope-fusion"],
    "the persistent layer norm is an apex CUDA kernel (torch's norm asserts it off)": [
        "--no-persist-layer-norm"],
}
#: Run settings pretrain_gpt needs to start at all (not model facts); fp32 for the comparison.
RUN_FLAGS = ["--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1",
             "--lr", "1e-4", "--mock-data", "--seed", "1234"]


@dataclass
class Result:
    """One Megatron-LM load of one format with one way of giving the model."""

    fmt: str
    mode: str
    flags: list[str]
    max_abs_diff: float | None
    error: str | None = None
    shims: list[str] | None = None

    def ok(self, tol: float) -> bool:
        return self.error is None and self.max_abs_diff is not None and self.max_abs_diff <= tol


def model_flags(config: dict[str, Any], tokenizer: Path) -> list[str]:
    """The flags of a standard Megatron-LM Llama launch for an HF Llama ``config``."""
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    flags = ["--num-layers", str(config["num_hidden_layers"]),
             "--hidden-size", str(config["hidden_size"]),
             "--ffn-hidden-size", str(config["intermediate_size"]),
             "--num-attention-heads", str(heads),
             "--kv-channels", str(config.get("head_dim") or config["hidden_size"] // heads),
             "--seq-length", str(TOKENS_SHAPE[1]),
             "--max-position-embeddings", str(config["max_position_embeddings"]),
             "--position-embedding-type", "rope", "--rotary-base", str(int(rope["rope_theta"])),
             "--normalization", "RMSNorm", "--norm-epsilon", str(config["rms_norm_eps"]),
             "--swiglu", "--disable-bias-linear",
             "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer)]
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    if not config.get("tie_word_embeddings", True):
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def launch(checkout: Path, spec: dict[str, Any], work: Path) -> None:
    """Run ``worker(spec)`` on TP gloo ranks through torchrun; raises with the ranks' output."""
    from toolkit.runtime.ports import free_port

    spec_file = work / f"spec-{spec['name']}.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={TP}",
           f"--master-port={free_port()}", __file__, str(checkout), "--worker", str(spec_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    (work / f"log-{spec['name']}.txt").write_text(done.stdout + done.stderr)
    if "load_return:" in done.stdout:  # load_checkpoint's non-strict retry after a strict failure
        raise RuntimeError("Megatron-LM's strict load failed and it fell back to a non-strict "
                           "one: " + next(line for line in done.stdout.splitlines()
                                          if "load_return:" in line))
    if done.returncode != 0:
        raise RuntimeError(f"Megatron-LM ranks failed (exit {done.returncode}):\n"
                           + first_traceback(done.stdout + done.stderr))


def first_traceback(log: str) -> str:
    """The end of the first failing rank's traceback in ``log`` (torchrun prefixes each line
    of it with ``[rankN]:``; its own summary comes after and says nothing of the cause)."""
    ranks: dict[str, list[str]] = {}
    for line in log.splitlines():
        m = re.match(r"\[rank(\d+)\]: ?(.*)", line)
        if m:
            ranks.setdefault(m.group(1), []).append(m.group(2))
    for lines in ranks.values():
        if any(line.startswith("Traceback") for line in lines):
            return "\n".join(lines[-20:])
    return "\n".join(log.splitlines()[-30:])


def _absent(name: str, needs: str, *functions: str) -> types.ModuleType:
    """A stand-in module whose ``functions`` raise, naming what the real module needs."""
    module = types.ModuleType(name)

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{name} is not available in this run: it needs {needs}")

    for f in functions:
        setattr(module, f, unavailable)
    return module


def megatron_lm_shims(checkout: Path) -> list[str]:
    """Let Megatron-LM's training code start here (CPU-only torch, megatron-core wheel); returns
    what was changed.

    megatron-core's CUDA-only calls go through mdtk's redirects (``toolkit.runtime.cpu_compat``,
    the same ones mdtk's own CPU runs use); on top, what ``megatron/training`` needs. Puts the
    checkout on ``sys.path`` after site-packages, so the installed megatron.core wins.
    """
    import torch

    sys.path.append(str(checkout))
    from toolkit import runtime

    shims = []
    if "six" not in sys.modules and importlib.util.find_spec("six") is None:
        # megatron/training/tokenizer imports its BERT tokenizer, which imports six (Python 2
        # compatibility) for six.PY2/six.PY3 only; six is not a dependency of mdtk's environment.
        six = types.ModuleType("six")
        six.PY2, six.PY3 = False, True  # type: ignore[attr-defined]
        sys.modules["six"] = six
        shims.append("six -> stub (PY2=False, PY3=True)")
    bik = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    if importlib.util.find_spec("triton") is None and bik not in sys.modules:
        # megatron/training/initialize imports it unconditionally for --batch-invariant-mode
        # (not used here); the module imports triton at the top, which needs CUDA.
        sys.modules[bik] = _absent(bik, "triton (for --batch-invariant-mode)",
                                   "enable_batch_invariant_mode")
        shims.append(f"{bik} -> stub (no triton)")
    # The dataset helpers come compiled with the megatron-core wheel, which ships no Makefile:
    # rank 0's `make` in initialize_megatron would fail (and exit) for nothing.
    from megatron.core.datasets import utils as dataset_utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        dataset_utils.compile_helpers = lambda: None
        shims.append("megatron.core.datasets.utils.compile_helpers -> no-op (wheel has them)")
    if torch.cuda.is_available():
        return shims
    runtime.enable_cpu_mode()
    # _initialize_distributed builds the model-parallel groups, and _set_random_seed seeds the
    # tensor-parallel RNG tracker, only when it counts a GPU; set_device is called with that.
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    # validate_args asks the GPU's architecture (tp > 1 on pre-Blackwell GPUs wants
    # CUDA_DEVICE_MAX_CONNECTIONS=1, which launch() sets as Megatron-LM's example scripts do).
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=0, minor=0, name="cpu", total_memory=0, multi_processor_count=1)
    # megatron/legacy/fused_kernels.load runs nvcc for CUDA kernels (none on CPU; the flags above
    # turn every fused kernel off).
    from megatron.legacy import fused_kernels

    fused_kernels.load = lambda *a, **k: None
    return [*shims, "megatron.legacy.fused_kernels.load -> no-op",
            "toolkit.runtime.cpu_compat", "torch.cuda.device_count -> 1",
            "torch.cuda.set_device -> no-op", "torch.cuda.get_device_properties -> arch 0"]


def worker(checkout: Path, spec: dict[str, Any]) -> None:
    """One rank: pretrain_gpt's start-up and checkpoint load, then a forward pass."""
    import torch

    torch.set_num_threads(1)
    shims = megatron_lm_shims(checkout)
    sys.argv = ["pretrain_gpt.py", *spec["flags"]]
    from functools import partial

    import megatron.core
    import pretrain_gpt
    from megatron.core import tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    assert not Path(megatron.core.__file__).is_relative_to(checkout), megatron.core.__file__
    # pretrain()'s first step, with pretrain_gpt's arguments; allow_no_cuda is Megatron-LM's own
    # switch for a run without CUDA (pretrain() asserts CUDA otherwise).
    initialize_megatron(args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
                        get_embedding_ranks=pretrain_gpt.get_embedding_ranks, allow_no_cuda=True)
    model, _, _ = setup_model_and_optimizer(
        partial(pretrain_gpt.model_provider, pretrain_gpt.gpt_builder),
        ModelType.encoder_or_decoder)
    args = get_args()
    tokens = torch.tensor(spec["tokens"])
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    module = model[0]
    module.eval()
    with torch.no_grad():
        logits = module(tokens, positions, None)
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    if torch.distributed.get_rank() == 0:
        torch.save({"logits": logits.float(), "iteration": args.iteration,
                    "padded_vocab_size": args.padded_vocab_size, "shims": shims,
                    "megatron_core": megatron.core.__file__}, spec["out"])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # A C++ thread left by the torch_dist load ("terminate called without an active exception")
    # can abort interpreter shutdown after the result is written (seen once in 4 runs): end here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check(checkout: Path, work: Path, only: list[str] | None = None) -> list[Result]:
    """Convert, load with Megatron-LM in every (format, flags) combination, compare logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.convert import convert
    from toolkit.demo import make_tiny_checkpoint
    from toolkit.parallel.layout import ParallelLayout

    hf = make_tiny_checkpoint(work / "hf", overrides=MODEL_OVERRIDES)
    config = json.loads((hf / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config["vocab_size"], TOKENS_SHAPE, generator=gen)
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(tokens).logits
    cpu = [f for flags in CPU_FLAGS.values() for f in flags]
    results = []
    for fmt, to in (("torch", "megatron-legacy"), ("torch_dist", "mcore")):
        ckpt = work / fmt  # converted afresh: a reused --work must not test an old conversion
        convert(hf, ckpt, to, ParallelLayout(tp=TP), overwrite=True, progress=False)
        for mode, model in (("explicit", model_flags(config, hf)),
                            ("checkpoint-args", ["--use-checkpoint-args"])):
            flags = [*model, "--tensor-model-parallel-size", str(TP), *cpu, *RUN_FLAGS,
                     "--load", str(ckpt)]
            name = f"{fmt}-{mode}"
            if only and name not in only:
                continue
            out = work / f"logits-{name}.pt"
            out.unlink(missing_ok=True)
            spec = {"name": name, "flags": flags, "tokens": tokens.tolist(), "out": str(out)}
            try:
                launch(checkout, spec, work)
                got = torch.load(out, weights_only=True)
                diff = (got["logits"][..., :config["vocab_size"]] - want).abs().max().item()
                results.append(Result(fmt, mode, flags, diff, shims=got["shims"]))
            except Exception as e:  # noqa: BLE001 - reported per run, the others still run
                results.append(Result(fmt, mode, flags, None, str(e)))
    return results


def describe_checkout(checkout: Path) -> str:
    """The checkout's commit (and tag) when it is a git work tree, else its path only."""
    try:
        out = subprocess.run(["git", "-C", str(checkout), "describe", "--tags", "--always",
                              "--long"], capture_output=True, text=True, timeout=30)
        head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=30)
    except OSError:
        return str(checkout)
    if head.returncode != 0:
        return f"{checkout} (not a git work tree)"
    return f"{checkout} ({out.stdout.strip()}, commit {head.stdout.strip()})"


def report(results: list[Result], checkout: Path, tol: float) -> str:
    """The summary: one line per run, the flags of each mode, the CPU shims."""
    lines = [f"Megatron-LM: {describe_checkout(checkout)}"]
    for r in results:
        shown = f"{r.max_abs_diff:.3e}" if r.max_abs_diff is not None else "-"
        lines.append(f"{'PASS' if r.ok(tol) else 'FAIL'} {r.fmt:10s} {r.mode:15s} "
                     f"logits max abs diff {shown} (tol {tol:g})")
        if r.error:
            lines.append("  " + r.error.replace("\n", "\n  "))
    for mode in dict.fromkeys(r.mode for r in results):
        flags = next(r.flags for r in results if r.mode == mode)
        lines.append(f"flags ({mode}): " + " ".join(flags[:-1]) + " DIR")
    shims = next((r.shims for r in results if r.shims), None)
    if shims:
        lines.append("shims: " + "; ".join(shims))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", type=Path, help="a Megatron-LM source checkout")
    p.add_argument("--work", type=Path, help="folder for the model, checkpoints and logs "
                   "(default: a temporary folder, removed afterwards)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest fp32 logits difference")
    p.add_argument("--only", nargs="+", metavar="RUN", help="only these runs: torch-explicit, "
                   "torch-checkpoint-args, torch_dist-explicit, torch_dist-checkpoint-args")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    checkout = a.checkout.resolve()
    if a.worker:
        worker(checkout, json.loads(a.worker.read_text()))
        return 0
    if not (checkout / "megatron" / "training" / "checkpointing.py").is_file():
        p.error(f"{checkout} is not a Megatron-LM checkout (no megatron/training/checkpointing.py)")
    with tempfile.TemporaryDirectory(prefix="mdtk-mlm-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = check(checkout, work, a.only)
    print(report(results, checkout, a.tol))
    return 0 if results and all(r.ok(a.tol) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
