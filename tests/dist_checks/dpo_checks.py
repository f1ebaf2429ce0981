"""Rank functions for the DPO checks (``toolkit.train.trainer.run`` with ``data.mode: dpo``).

Every case runs the real trainer on the bundled preference pairs: the policy is the trainer
tests' tiny Llama, the reference a second checkpoint (the same architecture, other weights), so
the reference log-probabilities really come from another model. The layout cases are compared
with the same config on one rank; the memory cases count what each rank holds.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_checks import trainer_checks as tc

DPO_DATA = ["bundled:examples/data/dpo.jsonl", "bundled:examples/data/dpo_text.jsonl"]
STEPS, MICRO, GLOBAL, SEQ, LR, BETA = 2, 2, 8, 48, 1e-3, 0.1
LORA = ("peft.method=lora", "peft.r=4", "dpo.reference=null")  # the reference: adapters off


@dataclass(frozen=True)
class DpoCase(tc.Case):
    """One DPO run: a trainer case (model, layout, DeepSpeed settings) plus the reference kind.
    ``model``'s reference is ``assets[reference_key(model)]``."""

    ref: str = "ref"  # the single-rank case to match
    steps: int = STEPS
    precompute: bool = False
    memory: bool = False  # also count the bytes each rank holds before the first update


def make_reference(policy: str | Path, out: str | Path, seed: int = 99) -> str:
    """A second checkpoint of the policy's architecture: its weights plus seeded noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(0.03 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return str(out)


def reference_key(model: str) -> str:
    """The assets' key of a model's DPO reference (``make_reference`` of it)."""
    return "reference" if model == "dense" else f"reference_{model}"


def config(case: DpoCase, assets: dict[str, str], out: str | Path):
    """The trainer tests' config (``trainer_checks.config``: model, layout, fp32, constant LR)
    turned into a DPO run on the bundled pairs with this module's batch and LR."""
    dpo = ("data.mode=dpo", f"data.sources=[{','.join(DPO_DATA)}]", f"dpo.beta={BETA}",
           f"dpo.reference={assets[reference_key(case.model)]}",
           f"dpo.precompute_reference={case.precompute}", f"optim.lr={LR}",
           f"train.micro_batch={MICRO}", f"train.global_batch={GLOBAL}", f"train.seq_len={SEQ}")
    return tc.config(dataclasses.replace(case, overrides=dpo + case.overrides), assets, out)


def run_case(case: DpoCase, assets: dict[str, str], workdir: str) -> dict[str, Any]:
    """Train ``case``; its per-step losses and metrics, what metrics.jsonl holds, and (with
    ``case.memory``) the bytes this rank holds."""
    from toolkit.train import trainer
    from toolkit.train.objectives.dpo import objective as dpo_objective

    out = Path(workdir) / case.name
    seen: dict[str, Any] = {}
    make_objective = dpo_objective.dpo_objective
    engine_spy = spy_engine(seen, "reference_held" if case.memory else None, case.grads)

    def objective_spy(*args, **kwargs):
        objective = make_objective(*args, **kwargs)
        seen["objective"] = objective
        mine, policy = getattr(objective.reference, "chunks", []), list(args[6])
        seen["reference_is_policy"] = bool(mine) and all(
            a is b for a, b in zip(mine, policy, strict=True))
        return objective

    result, records = run_spied(config(case, assets, out), [
        (trainer, "build_engine", engine_spy), (dpo_objective, "dpo_objective", objective_spy)])
    seen.pop("objective", None)
    return {"case": case.name, "losses": result.losses, "metrics": result.metrics,
            "records": records, "ds_config": result.ds_config, **seen}


def spy_engine(seen: dict[str, Any], memory_key: str | None = None, grads: bool = False):
    """A stand-in for ``trainer.build_engine`` that records the layout in ``seen`` and, with
    ``memory_key``, the bytes held before the first step (``measure_before_first_step``);
    ``grads``: the first step's gradients."""
    from megatron.core import parallel_state as ps

    from toolkit.train import trainer

    build_engine = trainer.build_engine

    def engine_spy(chunks, mpu, ds_config, **kwargs):
        seen.update(tp=ps.get_tensor_model_parallel_world_size(),
                    pp=ps.get_pipeline_model_parallel_world_size(),
                    cp=ps.get_context_parallel_world_size(), dp=ps.get_data_parallel_world_size())
        engine = build_engine(chunks, mpu, ds_config, **kwargs)
        if memory_key:
            measure_before_first_step(engine, seen, memory_key)
        if grads:
            from dist_checks.trainer_checks import _record_first_grads

            _record_first_grads(engine, seen)
        return engine

    return engine_spy


def run_spied(cfg, spies: list[tuple[Any, str, Any]]) -> tuple[Any, list[dict]]:
    """``trainer.run(cfg)`` with each ``(owner, name, spy)`` in place of ``owner.name`` (put
    back after); its result and, on rank 0, the records of its metrics.jsonl."""
    from toolkit.train import trainer

    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in spies]
    for owner, name, spy in spies:
        setattr(owner, name, spy)
    try:
        result = trainer.run(cfg)
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    records = []
    if dist.get_rank() == 0:
        path = Path(cfg.output_dir) / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
    return result, records


def measure_before_first_step(engine, seen: dict[str, Any], key: str = "reference_held") -> None:
    """Before the first ``engine.step``: the engine's bytes (parameters, gradients, optimizer:
    ``memory_checks.held_bytes``) and, under ``key``, the frozen model's beside it (a
    distillation teacher or a reference model ``seen["objective"]`` holds: its parameters,
    ZeRO-3 shards included), distinct storages."""
    from dist_checks.memory_checks import held_bytes

    step = engine.step

    def measuring_step(*args, **kwargs):
        if "held" not in seen:
            seen["held"] = held_bytes(engine)
            objective = seen.get("objective")
            frozen = getattr(objective, "teacher", None) or getattr(objective, "reference", None)
            chunks = getattr(frozen, "chunks", [])
            seen[key] = _param_bytes([p for c in chunks for p in c.parameters()])
        return step(*args, **kwargs)

    engine.step = measuring_step


def _param_bytes(params: list[torch.Tensor]) -> int:
    out: dict[int, int] = {}
    for p in params:
        for t in (p, getattr(p, "ds_tensor", None)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                st = t.untyped_storage()
                out[st.data_ptr()] = max(out.get(st.data_ptr(), 0), st.nbytes())
    return sum(out.values())


def run_cases(cases: list[DpoCase], assets: dict[str, str], workdir: str) -> list[dict[str, Any]]:
    return [run_case(c, assets, workdir) for c in cases]


def validation_at_start(name: str, rows: str, assets: dict[str, str], workdir: str,
                        seq_len: int) -> dict[str, Any]:
    """mdtk's validation before the first update on the pairs of ``rows`` (policy: the dense
    tiny Llama, reference: its perturbed copy): the loss and TRL's metrics."""
    from toolkit.train import trainer

    case = DpoCase(name, steps=1, overrides=(
        f"data.validation_sources=[{rows}]", "train.eval_interval=1", f"train.seq_len={seq_len}"))
    result = trainer.run(config(case, assets, Path(workdir) / name))
    return {"loss": result.val_losses[0], **result.val_metrics[0]}


def sft_then_dpo(workdir: str, sft_steps: int, dpo_steps: int) -> dict[str, Any]:
    """The demo's story continued: the demo's tiny Llama fine-tuned with the bundled SFT
    example, exported, then aligned with the bundled DPO example (the SFT model is the policy
    and, frozen, the reference); the held-out pairs' metrics before and after."""
    from toolkit import bundled
    from toolkit.demo import make_tiny_checkpoint
    from toolkit.train import trainer
    from toolkit.train.config import load_config

    root = Path(workdir) / "sft_then_dpo"
    model = make_tiny_checkpoint(root / "tiny-llama")
    quick = ["checkpoint.interval=0", "checkpoint.resume=none", "train.micro_batch=16",
             f"data.cache_dir={root / 'cache'}"]
    sft = load_config(bundled.SFT_EXAMPLE, [
        f"output_dir={root / 'sft'}", f"model.path={model}", f"export.hf_dir={root / 'sft_hf'}",
        f"train.steps={sft_steps}", "train.eval_interval=0", "optim.warmup_steps=3", *quick])
    trainer.run(sft)
    dpo = load_config("bundled:examples/dpo_tiny.yaml", [
        f"output_dir={root / 'dpo'}", f"model.path={root / 'sft_hf'}", f"model.tokenizer={model}",
        f"train.steps={dpo_steps}", f"train.eval_interval={dpo_steps}", "export.hf_dir=null",
        "optim.warmup_steps=2", *quick])
    result = trainer.run(dpo)
    return {"val": result.val_metrics, "losses": result.losses}


def single_rank_checks(assets: dict[str, str], workdir: str, refs: list[DpoCase],
                       validation: dict[str, str], seq_len: int, sft_steps: int,
                       dpo_steps: int) -> dict[str, Any]:
    """On one rank: the layout references, validation at step 0 per row form (vs TRL) and the
    SFT -> DPO run of the demo model."""
    return {"refs": run_cases(refs, assets, workdir),
            "validation": {form: validation_at_start(f"val_{form}", rows, assets, workdir,
                                                     seq_len)
                           for form, rows in validation.items()},
            "sft_then_dpo": sft_then_dpo(workdir, sft_steps, dpo_steps)}
