"""Run two checkpoints on the same fixed token batch and compare their logits (and layers).

A checkpoint spec is ``KIND:PATH`` or a bare path (its kind detected). Each kind has a runner
in ``RUNNERS`` returning the logits and the output of every decoder layer; other formats (e.g.
megatron-core checkpoints from the converter) add a runner and a detector here.

Kinds now: ``hf`` (transformers' own model class, fp32, eager attention: the reference),
``hf-mcore`` (the same HF folder loaded through mdtk's adapter into megatron-core, tp=1, in
this process: checks the adapter on a real checkpoint), ``mcore`` (a torch_dist checkpoint
loaded by megatron-core's own ``dist_checkpointing.load``) and ``megatron-legacy``
(``mp_rank_XX`` files of any tp/pp merged by the converter's reader). Megatron folders need the
``hf_config/`` folder the converter writes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from toolkit.adapters import ModelSpec


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


def hf_reference(path: str | Path) -> torch.nn.Module:
    """The transformers model of a folder (fp32, eager attention, eval), loaded by transformers
    itself. A config.json of a type transformers reads with another type's class (Kimi K2's
    ``kimi_k2``: ``Family.transformers_types``) is given as that class's config, so
    transformers' own model runs, never the folder's remote code."""
    from transformers import AutoModelForCausalLM

    from toolkit.adapters.spec import ModelSpec

    spec, native = ModelSpec.of(Path(path)), {}
    if spec.foreign:  # its model_type too: transformers picks its checkpoint renames by it
        native["config"] = copy.deepcopy(spec.transformers_config())
        native["config"].model_type = spec.transformers_type
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation="eager", **native)
    return model.eval()


def run_hf(path: Path, tokens: torch.Tensor, model: ModelSpec | None = None) -> Run:
    """The transformers reference model (``hf_reference``) of ``path`` on ``tokens``, with each
    decoder layer's output (``model`` is not used)."""
    model = hf_reference(path)
    # the decoder blocks: ``layers`` (``h`` in GPT-2), found by name (Llama 4's text model names
    # a ``base_model_prefix`` it does not have, so ``model.base_model`` is the model itself)
    blocks = next(m for name, m in model.named_modules()
                  if name.rsplit(".", 1)[-1] in ("layers", "h")
                  and isinstance(m, torch.nn.ModuleList))
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


def _run_chunks(chunks: list, vocab: int, tokens: torch.Tensor) -> Run:
    """Logits and per-layer outputs of megatron-core chunks (this process, tp=pp=1)."""
    from toolkit.adapters.live import forward_logits

    layers: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: layers.append(
        _first_output(out).detach().float().transpose(0, 1)))
        for chunk in chunks for layer in chunk.decoder.layers]
    try:
        logits = forward_logits(chunks, tokens, vocab)
    finally:
        for h in hooks:
            h.remove()
    return Run(logits, layers)


def run_hf_mcore(path: Path, tokens: torch.Tensor, model: ModelSpec | None = None) -> Run:
    """The HF folder loaded into megatron-core through mdtk's adapter (tp=pp=1, fp32);
    ``model``: its live ``ModelSpec`` when already read."""
    from toolkit import parallel, runtime
    from toolkit.adapters.live import load_hf
    from toolkit.parallel import ParallelLayout

    runtime.enable_cpu_mode()
    chunks, adapter = load_hf(model or path, ParallelLayout(), dtype=torch.float32)
    try:
        return _run_chunks(chunks, adapter.dims.vocab, tokens)
    finally:
        parallel.destroy()


def _megatron_model(path: Path, model: ModelSpec | None):
    """(chunks at tp=pp=1 fp32, adapter, source) for a Megatron checkpoint folder: the live
    model (transformers' own config of the folder the checkpoint carries, or ``model``)."""
    from toolkit import parallel, runtime
    from toolkit.adapters.live import build_model
    from toolkit.convert.sources import open_checkpoint

    op = open_checkpoint(path, spec=model, dtype=torch.float32, live=True)
    runtime.enable_cpu_mode()
    mpu = parallel.initialize(parallel.ParallelLayout())
    return build_model(op.adapter, mpu.layout), op.adapter, op


def run_mcore(path: Path, tokens: torch.Tensor, model: ModelSpec | None = None) -> Run:
    """A torch_dist checkpoint loaded by megatron-core's own ``dist_checkpointing.load``."""
    from megatron.core import dist_checkpointing

    from toolkit import parallel
    from toolkit.checkpoint.mcore_dist import marker
    from toolkit.checkpoint.megatron_layout import checkpoint_dir

    chunks, adapter, op = _megatron_model(path, model)
    try:
        op.source.close()
        folder, _ = checkpoint_dir(path, marker)
        # Megatron-LM's layout: the model under "model", run metadata (common.pt) beside it.
        state = dist_checkpointing.load({"model": chunks[0].sharded_state_dict()}, str(folder))
        chunks[0].load_state_dict(state["model"], strict=True)
        return _run_chunks(chunks, adapter.dims.vocab, tokens)
    finally:
        parallel.destroy()


def run_megatron_legacy(path: Path, tokens: torch.Tensor, model: ModelSpec | None = None
                        ) -> Run:
    """A legacy ``mp_rank_XX`` checkpoint (any tp/pp) merged by mdtk's reader, run at tp=1."""
    from toolkit import parallel
    from toolkit.adapters.live import fill_chunks

    chunks, adapter, op = _megatron_model(path, model)
    try:
        fill_chunks(chunks, adapter, op.source)
        return _run_chunks(chunks, adapter.dims.vocab, tokens)
    finally:
        op.source.close()
        parallel.destroy()


RUNNERS: dict[str, Callable[..., Run]] = {  # (path, tokens, model=None) -> Run
    "hf": run_hf,
    "hf-mcore": run_hf_mcore,
    "mcore": run_mcore,
    "megatron-legacy": run_megatron_legacy,
}


def detect(path: Path) -> str:
    """The kind of a bare path."""
    from toolkit.adapters.spec import has_config

    if has_config(path):
        return "hf"
    from toolkit.checkpoint import CheckpointError
    from toolkit.convert.sources import detect as detect_format

    try:
        kind = detect_format(path)
    except CheckpointError:
        kind = None
    if kind in RUNNERS:
        return kind
    raise ValueError(f"{path}: cannot tell its format (no config.json); write KIND:PATH with "
                     f"KIND in {sorted(RUNNERS)}.")


def parse_spec(spec: str) -> tuple[str, Path]:
    kind, sep, rest = spec.partition(":")
    if sep and kind in RUNNERS:
        return kind, Path(rest)
    path = Path(spec)
    return detect(path), path


#: The converter's format of each kind: its files are opened and checked as ``mdtk convert``
#: and ``mdtk inspect`` open them before anything runs.
FORMATS = {"hf": "hf", "hf-mcore": "hf", "mcore": "mcore", "megatron-legacy": "megatron-legacy"}


def checked(kind: str, path: Path) -> ModelSpec:
    """Open ``path`` as the converter does (safetensors headers and sizes, config.json's types,
    tensor names and shapes against it: one ``UserError`` naming the file on damage) and return
    the model as read (live for the megatron-core runners, its fp32 mapping built)."""
    from toolkit.convert.sources import open_checkpoint

    opened = open_checkpoint(path, fmt=FORMATS[kind], dtype=torch.float32, live=kind != "hf")
    opened.source.close()
    return opened.spec


def checked_vocab(kind: str, path: Path) -> int:
    """``checked``'s model's vocab size."""
    return checked(kind, path).dims.vocab


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


def _world(needed: bool) -> contextlib.AbstractContextManager:
    """megatron-core runners need torch.distributed: the launch's, or a world of one (this
    process, ended afterwards); transformers' runner needs none."""
    from toolkit import runtime

    return runtime.joined() if needed else contextlib.nullcontext()


def verify(spec_a: str, spec_b: str, *, batch: int = 2, seq_len: int = 16,
           seed: int = 0) -> Comparison:
    """Run both checkpoints on the same tokens and compare."""
    kind_a, path_a = parse_spec(spec_a)
    kind_b, path_b = parse_spec(spec_b)
    models = [checked(kind_a, path_a), checked(kind_b, path_b)]  # both before either runs
    tokens = fixed_tokens(models[0].dims.vocab, batch, seq_len, seed)
    # transformers runs first: once megatron-core's CPU mode is on in this process, a
    # transformers model loaded afterwards gets uninitialised RoPE buffers (the CPU redirects
    # of torch.tensor hide torch.device("meta") from transformers' loader).
    order = sorted([(0, kind_a, path_a), (1, kind_b, path_b)], key=lambda x: x[1] != "hf")
    with _world(needed=kind_a != "hf" or kind_b != "hf"):
        runs = {i: RUNNERS[kind](path, tokens, models[i]) for i, kind, path in order}
    return compare(runs[0], runs[1])
