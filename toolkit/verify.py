"""Run two checkpoints on the same fixed token batch and compare their logits (and layers).

A checkpoint spec is ``KIND:PATH`` or a bare path (its kind detected). Each kind has a runner
in ``RUNNERS`` returning the logits and the output of every decoder layer; other formats (e.g.
megatron-core checkpoints from the converter) add a runner and a detector here.

Kinds now: ``hf`` (transformers' own model class, fp32, eager attention: the reference) and
``hf-mcore`` (the same HF folder loaded through mdtk's adapter into megatron-core, tp=1, in
this process: checks the adapter on a real checkpoint).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Run:
    logits: torch.Tensor  # [batch, seq, vocab] float32
    layers: list[torch.Tensor]  # output of each decoder layer, [batch, seq, hidden]


@dataclass
class Comparison:
    max_abs: float
    max_rel: float  # max |a - b| / max |a|
    layers: list[float]  # max abs diff per decoder layer output

    def ok(self, tol: float) -> bool:
        return self.max_abs <= tol


def _first_output(output: object) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output  # type: ignore[return-value]


def run_hf(path: Path, tokens: torch.Tensor) -> Run:
    """The transformers reference model (fp32, eager attention) loaded from ``path``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    base = model.base_model
    blocks = getattr(base, "layers", None) or base.h
    layers: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda _m, _i, out: layers.append(
        _first_output(out).detach().float())) for b in blocks]
    try:
        with torch.no_grad():
            logits = model(tokens).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return Run(logits, layers)


def _single_process_dist() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    from toolkit.testing.distributed import free_port

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


def run_hf_mcore(path: Path, tokens: torch.Tensor) -> Run:
    """The HF folder loaded into megatron-core through mdtk's adapter (tp=pp=1, fp32)."""
    from toolkit import parallel, runtime
    from toolkit.bridge import forward_logits, load_hf
    from toolkit.parallel import ParallelLayout

    _single_process_dist()
    runtime.enable_cpu_mode()
    chunks, adapter = load_hf(path, ParallelLayout(), dtype=torch.float32)
    try:
        layers: list[torch.Tensor] = []
        hooks = [layer.register_forward_hook(lambda _m, _i, out: layers.append(
            _first_output(out).detach().float().transpose(0, 1)))
            for chunk in chunks for layer in chunk.decoder.layers]
        try:
            logits = forward_logits(chunks, tokens, adapter.dims.vocab)
        finally:
            for h in hooks:
                h.remove()
    finally:
        parallel.destroy()
    return Run(logits, layers)


RUNNERS: dict[str, Callable[[Path, torch.Tensor], Run]] = {
    "hf": run_hf,
    "hf-mcore": run_hf_mcore,
}


def detect(path: Path) -> str:
    """The kind of a bare path."""
    if (path / "config.json").is_file():
        return "hf"
    raise ValueError(f"{path}: cannot tell its format (no config.json); write KIND:PATH with "
                     f"KIND in {sorted(RUNNERS)}.")


def parse_spec(spec: str) -> tuple[str, Path]:
    kind, sep, rest = spec.partition(":")
    if sep and kind in RUNNERS:
        return kind, Path(rest)
    path = Path(spec)
    return detect(path), path


def vocab_size(path: Path) -> int:
    import json

    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def fixed_tokens(vocab: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len), generator=g)


def compare(a: Run, b: Run) -> Comparison:
    if a.logits.shape != b.logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(a.logits.shape)} vs "
                         f"{tuple(b.logits.shape)} (different vocab or model?).")
    diff = (a.logits - b.logits).abs().max().item()
    scale = a.logits.abs().max().item() or 1.0
    layers = [(x - y).abs().max().item() if x.shape == y.shape else float("nan")
              for x, y in zip(a.layers, b.layers, strict=False)]
    return Comparison(diff, diff / scale, layers)


def verify(spec_a: str, spec_b: str, *, batch: int = 2, seq_len: int = 16,
           seed: int = 0) -> Comparison:
    """Run both checkpoints on the same tokens and compare."""
    kind_a, path_a = parse_spec(spec_a)
    kind_b, path_b = parse_spec(spec_b)
    tokens = fixed_tokens(vocab_size(path_a), batch, seq_len, seed)
    # transformers runs first: once megatron-core's CPU mode is on in this process, a
    # transformers model loaded afterwards gets uninitialised RoPE buffers (the CPU redirects
    # of torch.tensor hide torch.device("meta") from transformers' loader).
    order = sorted([(0, kind_a, path_a), (1, kind_b, path_b)], key=lambda x: x[1] != "hf")
    runs = {i: RUNNERS[kind](path, tokens) for i, kind, path in order}
    return compare(runs[0], runs[1])
