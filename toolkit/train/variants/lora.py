"""LoRA / DoRA in a training run: adapters on the loaded model, their checkpoints, their export.

- ``attach_adapters``: after the base model is loaded, every targeted projection gets its adapter
  (``toolkit.lora``): drawn from the run's seed over full HF shapes (the same at every layout) or
  read from ``peft.adapter`` (an HF PEFT folder); the base is frozen in the training dtype.
- Checkpoints hold the adapters and their optimizer state only, as full HF-named tensors:
  ``adapter/`` (a PEFT folder with the fp32 master weights) and ``adapter_optimizer.safetensors``
  (Adam's moments). Any layout reads them back (``load_state``), so resume at another layout is
  the same code path as resume at the same one, and exact.
- Export: ``export.adapter_dir`` (a PEFT folder), ``export.hf_dir`` (the base with the adapters
  merged in float32, written in the model's dtype).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from toolkit.atomic import building
from toolkit.checkpoint.deepspeed import MOMENTS
from toolkit.errors import ConfigError
from toolkit.lora import LoraError, LoraSpec
from toolkit.lora.peft_io import CHECKPOINT_ADAPTER as ADAPTER_DIR
from toolkit.lora.peft_io import CONFIG, WEIGHTS, config_dict, read_config

OPTIMIZER_FILE = "adapter_optimizer.safetensors"


def spec_of(cfg: Any) -> LoraSpec | None:
    """The run's adapter spec (None: full fine-tuning); ``peft.adapter``'s own when given."""
    p = cfg.peft
    if p.method == "none":
        return None
    if p.adapter:
        spec, _ = read_config(p.adapter)
        return spec
    try:
        return LoraSpec(method=p.method, r=p.r, alpha=p.alpha, dropout=p.dropout,
                        targets=frozenset(p.target_modules or ()), rslora=p.rslora)
    except LoraError as e:
        raise ConfigError(str(e)) from None


def attach_adapters(cfg: Any, chunks: list[Any], adapter: Any) -> LoraSpec:
    """Adapters on this rank's chunks (base frozen); returns the spec with resolved targets."""
    from megatron.core import parallel_state as ps

    from toolkit.adapters.live import current_coord
    from toolkit.lora.attach import SeededAdapters, attach, folder_source
    from toolkit.lora.targets import adapter_spec, projections

    spec = spec_of(cfg)
    table = adapter.table(1)
    try:
        spec = adapter_spec(adapter, spec)
        if cfg.peft.adapter:
            source = folder_source(cfg.peft.adapter, adapter, spec)
        else:
            shapes = {p.module: (p.out_features, p.in_features) for p in projections(table)}
            source = SeededAdapters(cfg.train.seed, spec.r, shapes)
    except LoraError as e:
        raise ConfigError(str(e)) from None
    attach(chunks, adapter, spec, current_coord(), source,
           tp_group=ps.get_tensor_model_parallel_group())
    return spec


# -- reading and writing the engine's adapter state ----------------------------------------------

def _replica() -> bool:
    """A data- or context-parallel copy of another rank's adapter slices."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(with_context_parallel=True) != 0


def _master(engine: Any):
    from deepspeed.utils import safe_get_full_fp32_param

    base = getattr(engine.optimizer, "optimizer", engine.optimizer)

    def get(p: torch.nn.Parameter) -> torch.Tensor:
        value = safe_get_full_fp32_param(p)
        return p.data if value is None else value  # ZeRO-0: the optimizer steps p itself
    get.base = base
    return get


def _moment(engine: Any, key: str):
    from deepspeed.utils import safe_get_full_optimizer_state

    base = getattr(engine.optimizer, "optimizer", engine.optimizer)

    def get(p: torch.nn.Parameter) -> torch.Tensor | None:
        value = safe_get_full_optimizer_state(p, key)
        return base.state.get(p, {}).get(key) if value is None else value
    return get


def save_state(folder: Path, engine: Any, chunks: list[Any], adapter: Any, spec: LoraSpec,
               base: str | None) -> None:
    """Collective: the adapters' fp32 master weights and Adam moments into ``folder``."""
    from safetensors.torch import save_file

    from toolkit.lora.state import gather_full

    replica = _replica()
    weights = gather_full(chunks, _master(engine), replica=replica)
    moments = {k: gather_full(chunks, _moment(engine, k), replica=replica) for k in MOMENTS}
    if dist.get_rank() == 0:
        write_peft_folder(folder / ADAPTER_DIR, weights, spec, base, adapter)
        flat = {f"{k}.{n}": t.contiguous() for k, ts in moments.items() for n, t in ts.items()}
        save_file(flat, str(folder / OPTIMIZER_FILE))


def write_peft_folder(out: Path, tensors: dict[str, torch.Tensor], spec: LoraSpec,
                      base: str | None, adapter: Any, dtype: torch.dtype | None = None) -> Path:
    """An HF PEFT folder (atomic): ``adapter_config.json`` + ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    from toolkit.lora.targets import fan_in_fan_out as transposed

    fan_in_fan_out = transposed(adapter.table(1), spec.targets)
    with building(out) as tmp:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({n: (t.to(dtype) if dtype else t).contiguous() for n, t in tensors.items()},
                  str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config_dict(spec, base, fan_in_fan_out), indent=2))
    return out


def has_state(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_DIR / WEIGHTS).is_file()


def refuse_adapters_for_full_run(folder: Path) -> None:
    """A full fine-tuning run cannot resume from a checkpoint of adapters."""
    from toolkit.train.checkpoints.state import ResumeError

    if has_state(folder):
        raise ResumeError(f"{folder} holds LoRA adapters (no full model): resume it with the "
                          "run's peft settings, or start fresh with checkpoint.resume=none.")


def load_state(folder: Path, engine: Any, chunks: list[Any], spec: LoraSpec, step: int,
               samples: int) -> None:
    """Fill the engine (any layout) from ``save_state``'s files: weights, fp32 masters, Adam."""
    from safetensors.torch import load_file

    from toolkit.train.checkpoints.state import ResumeError

    if not has_state(folder):
        raise ResumeError(f"{folder} is a full fine-tuning checkpoint, this run trains adapters "
                          "(peft.method): start the adapters fresh with checkpoint.resume=none, "
                          "or continue from an HF PEFT folder with peft.adapter.")
    saved, _ = read_config(Path(folder) / ADAPTER_DIR)
    if (saved.method, saved.r, saved.targets) != (spec.method, spec.r, spec.targets):
        raise ResumeError(f"{folder} holds {saved.method} adapters r={saved.r} on "
                          f"{sorted(saved.targets)}, this run has {spec.method} r={spec.r} on "
                          f"{sorted(spec.targets)}: restore the peft settings.")
    from toolkit.lora.attach import local_part
    from toolkit.lora.state import adapter_params
    from toolkit.train.checkpoints.reshard import write_engine_state

    weights = load_file(str(Path(folder) / ADAPTER_DIR / WEIGHTS))
    optim = load_file(str(Path(folder) / OPTIMIZER_FILE))
    values = []
    for name, param, s, kind in adapter_params(chunks):
        moments = {k: local_part(s, kind, optim[f"{k}.{name}"]) for k in MOMENTS}
        values.append((param, local_part(s, kind, weights[name]), moments))
    write_engine_state(engine, values, step, samples)


def gathered(chunks: list[Any]) -> contextlib.AbstractContextManager[None]:
    """ZeRO-3: the adapter parameters whole inside the block."""
    from toolkit import runtime
    from toolkit.lora.layers import branches

    return runtime.zero3_gathered(p for _, _, b in branches(chunks) for p in b.parameters())


def export_adapter(chunks: list[Any], adapter: Any, spec: LoraSpec, out_dir: str,
                   base: str | None) -> str | None:
    """Collective: the live adapters as an HF PEFT folder on rank 0 (its path there)."""
    from toolkit.lora.state import gather_full

    with gathered(chunks):
        tensors = gather_full(chunks, lambda p: p.data, replica=_replica())
    path = None
    if dist.get_rank() == 0:
        path = str(write_peft_folder(Path(out_dir), tensors, spec, base, adapter))
    dist.barrier()
    return path


def export_merged(chunks: list[Any], adapter: Any, spec: LoraSpec, base: str,
                  adapter_dir: str, out_dir: str, *, verify: bool
                  ) -> tuple[str | None, float | None]:
    """Collective: ``base`` with the adapter folder ``adapter_dir`` merged (float32, written in
    the model's dtype) into ``out_dir`` on rank 0; with ``verify`` its logits (transformers) vs
    the live model's: returns (folder, max abs diff)."""
    from toolkit.lora.merge import merge_folder
    from toolkit.train.variants.export import verify_export

    problem: list[Any] = [None]
    path = None
    if dist.get_rank() == 0:
        try:
            path = str(merge_folder(base, adapter_dir, out_dir, overwrite=True))
        except (OSError, LoraError) as e:
            problem = [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ConfigError(f"export.hf_dir={out_dir}: {problem[0]}")
    diff = None
    if verify:
        with gathered(chunks):
            diff = verify_export(chunks, adapter, out_dir)
    return path, diff


def verify_adapter(chunks: list[Any], adapter: Any, base: str, adapter_dir: str) -> float:
    """Max abs logit difference on every rank: PEFT's own model (``PeftModel.from_pretrained``
    over the base with the exported folder, fp32) vs the live model, on a fixed batch."""
    from toolkit.train.variants.export import verify_against

    return verify_against(chunks, adapter, lambda tokens: peft_logits(base, adapter_dir, tokens))


def peft_logits(base: str, adapter_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of PEFT's model: the HF base (fp32, eager attention) with the adapter folder."""
    from peft import PeftModel
    from transformers.utils import logging as hf_logging

    from toolkit.convert.verify import hf_reference

    hf_logging.disable_progress_bar()
    model = PeftModel.from_pretrained(hf_reference(base), adapter_dir)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def export(cfg: Any, chunks: list[Any], adapter: Any, spec: LoraSpec, result: Any,
           log: Any) -> None:
    """Collective: ``export.adapter_dir`` (PEFT folder) and ``export.hf_dir`` (merged model),
    each checked against the live model when ``export.verify``; fills ``result``."""
    import tempfile

    base = cfg.model.path
    with contextlib.ExitStack() as stack:
        folder = cfg.export.adapter_dir
        if folder is None:  # the merge reads a PEFT folder: a temporary one
            tmp = [stack.enter_context(tempfile.TemporaryDirectory()) if dist.get_rank() == 0
                   else None]
            dist.broadcast_object_list(tmp, src=0)
            folder = str(Path(tmp[0]) / ADAPTER_DIR)
        result.adapter_dir = export_adapter(chunks, adapter, spec, folder, base)
        if cfg.export.adapter_dir and cfg.export.verify:
            with gathered(chunks):
                result.adapter_max_abs_diff = verify_adapter(chunks, adapter, base, folder)
        if cfg.export.adapter_dir and result.adapter_dir is not None:
            diff = result.adapter_max_abs_diff
            log(f"exported the adapters (HF PEFT) to {folder}" + (
                f" (PEFT's logits vs trained model: max abs diff {diff:.2e})" if diff is not None
                else ""))
        if not cfg.export.adapter_dir:
            result.adapter_dir = None
        if cfg.export.hf_dir:
            result.export_dir, result.export_max_abs_diff = export_merged(
                chunks, adapter, spec, base, folder, cfg.export.hf_dir,
                verify=cfg.export.verify)
            if result.export_dir is not None:
                log(f"exported the merged model to {result.export_dir}")
        dist.barrier()
