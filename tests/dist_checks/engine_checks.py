"""Rank functions for the training-engine parity checks (toolkit.train.loop.engine).

Every case trains the same tiny megatron-core GPT for a few AdamW steps through
``build_engine`` / ``train_step`` (megatron-core schedules inside a real DeepSpeed engine) and
compares each step's loss with the full model trained in one process by ``torch.optim.AdamW``
with the same clipping, on the same global batches. The layouts differ only in how the model,
the batch and the gradient reduction are split, so any bug shows as a loss difference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from dist_checks import gpt_checks as gc
from toolkit import parallel
from toolkit.parallel import ParallelLayout
from toolkit.train.loop import engine as te

LR, CLIP, STEPS = 1e-2, 1.0, 5


@dataclass(frozen=True)
class Case:
    """One layout to train: parallel sizes, ZeRO stage, micro-batches per step."""

    name: str
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    sp: bool = False
    zero: int = 1
    offload: bool = False
    micro: int = 2
    n_micro: int = 1  # micro-batches per rank per step (gradient accumulation)
    experts: int | None = None

    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep,
                              sequence_parallel=self.sp)


def global_batches(case: Case, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches (one per step) for every layout with this global batch size."""
    size = dp * case.n_micro * case.micro
    return [gc.batch(size, seed=100 + step) for step in range(STEPS)]


def reference(case: Case, dp: int, weights) -> tuple[list[float], list[float]]:
    """Full model, one process, torch AdamW, same clipping as DeepSpeed's gradient_clipping.

    Returns the per-step mean loss and gradient norm (before clipping).
    """
    parallel.initialize(ParallelLayout(), seed=gc.SEED)
    (model,) = gc.build(ParallelLayout().resolve(dist.get_world_size()), num_experts=case.experts)
    model.load_state_dict(weights, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    n = dp * case.n_micro  # micro-batches in the global batch
    losses, norms = [], []
    for tokens, labels in global_batches(case, dp):
        opt.zero_grad()
        total = 0.0
        for i in range(n):
            sl = slice(i * case.micro, (i + 1) * case.micro)
            loss = gc.lm_loss(model, tokens[sl], labels[sl])
            (loss / n).backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(total / n)
    parallel.destroy()
    return losses, norms


def full_weights(case: Case) -> dict[str, torch.Tensor]:
    parallel.initialize(ParallelLayout(), seed=gc.SEED)
    (model,) = gc.build(ParallelLayout().resolve(dist.get_world_size()), num_experts=case.experts)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()
               if not k.endswith("_extra_state")}
    parallel.destroy()
    return weights


def ds_config(case: Case, dp: int) -> dict:
    zero: dict = {"stage": case.zero}
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_batch_size": dp * case.n_micro * case.micro,
        "train_micro_batch_size_per_gpu": case.micro,
        "gradient_accumulation_steps": case.n_micro,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def train_case(case: Case) -> dict:
    """Train ``case`` on this rank; return its per-step losses and the reference's."""
    world = dist.get_world_size()
    dp = case.layout().resolve(world).dp
    weights = full_weights(case)
    ref, ref_norms = reference(case, dp, weights)
    start = time.perf_counter()
    mpu = parallel.initialize(case.layout(), seed=gc.SEED)
    chunks = gc.build(mpu.layout, num_experts=case.experts)
    gc.load_from_full(chunks, weights)
    engine = te.build_engine(chunks, mpu, ds_config(case, dp))
    dp_rank = mpu.get_data_parallel_rank()
    per_rank = case.n_micro * case.micro
    results = []
    for tokens, labels in global_batches(case, dp):
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        tok, lab = tokens[mine], labels[mine]
        micro_batches = iter([
            {"tokens": tok[i * case.micro:(i + 1) * case.micro],
             "labels": lab[i * case.micro:(i + 1) * case.micro]}
            for i in range(case.n_micro)
        ])
        results.append(te.train_step(engine, chunks, micro_batches,
                                     num_microbatches=case.n_micro, micro_batch=case.micro,
                                     seq_len=gc.SEQ))
    out = {
        "case": case.name, "ref": ref, "losses": [r.loss for r in results],
        "ref_norms": ref_norms, "grad_norms": [r.grad_norm for r in results],
        "lrs": [r.lr for r in results], "optimizer": type(engine.basic_optimizer).__name__,
        "dp": dp, "seconds": time.perf_counter() - start,
        "local_experts": (len(chunks[0].decoder.layers[0].mlp.experts.local_experts)
                          if case.experts else None),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
    }
    engine.destroy()
    parallel.destroy()
    return out


def train_cases(cases: list[Case]) -> list[dict]:
    return [train_case(c) for c in cases]


def refusals(cases: list[Case]) -> list[str]:
    """The EngineError text build_engine raises for each case ("" if it builds an engine)."""
    return [_refusal(c) for c in cases]


def _refusal(case: Case) -> str:
    dp = case.layout().resolve(dist.get_world_size()).dp
    mpu = parallel.initialize(case.layout(), seed=gc.SEED)
    chunks = gc.build(mpu.layout, num_experts=case.experts)
    try:
        engine = te.build_engine(chunks, mpu, ds_config(case, dp))
    except te.EngineError as e:
        return str(e)
    else:
        engine.destroy()
        return ""
    finally:
        parallel.destroy()
