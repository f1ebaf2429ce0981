"""One training step: megatron-core's forward/backward schedules inside a real DeepSpeed engine.

megatron-core runs the micro-batches (no pipelining, 1F1B, or interleaved 1F1B with vpp chunks)
directly on the rank's model chunks; DeepSpeed owns the optimizer, ZeRO partitioning, offload,
gradient clipping and the data-parallel reduction. The two meet in three places:

- Gradient reduction. The schedule calls ``backward`` itself, once per micro-batch and, with
  pipelining, interleaved with forwards of other micro-batches, so ``engine.backward`` is never
  used. The whole schedule runs inside ``engine.coalesce_grad_reduction()``: ZeRO's per-parameter
  gradient hooks stand aside, gradients accumulate in ``param.grad``, and on leaving the block
  DeepSpeed reduces (ZeRO-1/2: reduce-scatter into the partitions; ZeRO-3: reduce and partition)
  the accumulated gradients exactly once over the data-parallel group. Hooking the schedule's
  per-micro-batch backwards into ZeRO's per-backward epilogue instead fails ("Gradient computed
  twice", or ``KeyError`` in ``step`` when the epilogue never ran). ZeRO-0 reduces with
  ``engine.allreduce_gradients()``. Trade-off: until the reduction, each rank holds the full
  gradients of its model shard (as ZeRO-1 does); ZeRO-2/3 partition them from the reduction on.
- The reductions megatron-core's own DDP would do (TP-sum of sequence-parallel and q/k-norm
  grads, tied embedding grads summed across the first and last pipeline stage) run on
  ``param.grad`` inside that block, before DeepSpeed sees the gradients.
- One ``engine.step()`` is one optimizer step: the engine's accumulation boundary is pinned to
  True (the schedule already accumulated ``num_microbatches`` micro-batches).
- The loss. A loss function returns its micro-batch's share of the global batch's loss
  (``toolkit.train.loop.loss``: token-weighted over the whole global batch by default); the share is
  scaled by ``num_microbatches x dp`` for backward, undoing the schedule's division by the
  micro-batches and DeepSpeed's average over data parallel, and the shares summed are the loss.

Supported: ZeRO 0-3 at pp=1; ZeRO 1-2 with pp>1 (1F1B and interleaved), which DeepSpeed's own
PipelineEngine refuses for stage 2 (so do mdtk's configs: ``toolkit.rules``; the engine alone
runs it). Refused up front (``engine_rules.check_supported``): ZeRO-3
with pp>1, ZeRO-3 with experts, ZeRO-0 with clipping and pp>1 or experts, fp16, and bf16 ZeRO-1
with fp32 gradient accumulation; each message says why.

Experts: megatron-core marks expert parameters ``allreduce=False``, which DeepSpeed already reads
as "MoE parameter". They are tagged with DeepSpeed's group name and megatron-core's expert
groups are registered with DeepSpeed, so ZeRO partitions and reduces them over the
expert-data-parallel group only (scaled by 1/dp like megatron-core's DDP).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from toolkit import runtime
from toolkit.models.cp_attention import context_parallel_share
from toolkit.models.packed import localise, segments_of
from toolkit.models.vocab import mask_vocab_padding  # noqa: F401 - the trainer's
from toolkit.parallel.grads import finalize_grads
from toolkit.train.loop.engine_rules import (
    EngineError,
    check_supported,
    with_optimizer_defaults,
)
from toolkit.train.loop.loss import (
    Batch,
    LossFn,
    StepCounts,
    count_step,
    local_shares,
    loss_names,
    reduce_shares,
    token_mean,
)
from toolkit.train.loop.step_values import PendingStep, StepResult, resolve_steps

# -- engine ------------------------------------------------------------------------------------

def build_engine(
    chunks: Sequence[torch.nn.Module],
    mpu: Any,
    ds_config: dict[str, Any],
    *,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    checked: bool = False,
):
    """Wrap this rank's model chunks in a DeepSpeed engine over ``mpu``'s data-parallel group.

    ``chunks``: one GPTModel, or the vpp chunks of interleaved pipelining (wrapped in a
    ``torch.nn.ModuleList`` for DeepSpeed; the schedule still runs the chunks themselves).
    ``ds_config`` must name the optimizer; its batch keys must match the step's micro batch and
    ``num_microbatches`` (gradient_accumulation_steps). ``lr_scheduler``: optional callable
    ``optimizer -> scheduler`` stepped by DeepSpeed after each update; alternatively pass
    ``lr=`` to :func:`train_step` (a stateless schedule). ``checked``: the caller already ran
    :func:`check_supported` on ``ds_config`` (the trainer does, before it builds the model).
    """
    chunks = list(chunks)
    if not chunks:
        raise EngineError("build_engine needs at least one model chunk.")
    if "optimizer" not in ds_config:
        raise EngineError("ds_config has no 'optimizer' section: mdtk trains with DeepSpeed's "
                          "optimizer (e.g. {'type': 'AdamW', 'params': {'lr': 1e-4}}).")
    experts = [p for c in chunks for p in c.parameters() if getattr(p, "allreduce", True) is False]
    if not checked:
        check_supported(ds_config, pp=ps.get_pipeline_model_parallel_world_size(),
                        has_experts=bool(experts))
    ds_bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    if ds_bf16 != bool(getattr(chunks[0].config, "bf16", False)):
        raise EngineError(
            f"DeepSpeed bf16.enabled={ds_bf16} but the model's TransformerConfig has "
            f"bf16={getattr(chunks[0].config, 'bf16', False)}: build the model with the same "
            "precision (params_dtype and pipeline_dtype too)."
        )
    runtime.prepare_deepspeed()
    config = with_optimizer_defaults(ds_config, cuda=runtime.use_cuda())
    module = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
    mark_tensor_parallel_params(chunks)
    _mark_pipeline_replicas(chunks)
    if experts:
        _register_expert_groups(experts)
    # frozen experts (LoRA) still need their groups (DeepSpeed broadcasts them over the
    # expert-data-parallel group) but no MoE optimizer groups
    trained = any(p.requires_grad for p in experts)
    engine = _initialize(module, config, mpu, lr_scheduler, has_experts=trained)
    # One engine.step() per optimizer step: the schedule already accumulated the micro-batches.
    engine.set_gradient_accumulation_boundary(True)
    return engine


def place_like_engine(chunks: Sequence[torch.nn.Module]) -> None:
    """Move ``chunks`` where ``build_engine``'s DeepSpeed engine moves the policy (below
    ZeRO-3: ``module.to(engine.device)``, the accelerator's device of LOCAL_RANK, which
    ``runtime.init_distributed`` made current): for models that run beside the policy without
    an engine of their own (DPO's frozen reference)."""
    device = runtime.device()
    for chunk in chunks:
        chunk.to(device)


def _initialize(module, config, mpu, lr_scheduler, *, has_experts: bool):
    import deepspeed

    params = [p for p in module.parameters() if p.requires_grad]  # LoRA: the adapters only
    if not has_experts:
        engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=config,
                                          mpu=mpu, lr_scheduler=lr_scheduler)
        return engine
    # DeepSpeed turns on its MoE handling (expert optimizer groups partitioned and reduced over
    # the expert-data-parallel group, expert-aware grad norm) only when it finds its own MoE
    # modules, before it builds the optimizer. megatron-core's experts need the same, so build
    # a DeepSpeedEngine that says so, the way deepspeed.initialize builds one.
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    class ExpertEngine(DeepSpeedEngine):
        def _configure_distributed_model(self, model):
            self.has_moe_layers = True
            super()._configure_distributed_model(model)

    engine = ExpertEngine(args=None, model=module, model_parameters=params,
                          lr_scheduler=lr_scheduler, mpu=mpu, config=config,
                          config_class=DeepSpeedConfig(config, mpu))
    engine._configure_python_gc()
    return engine


def _register_expert_groups(experts: list[torch.nn.Parameter]) -> str:
    """Give DeepSpeed megatron-core's expert (data-)parallel groups; tag the expert params."""
    from deepspeed.utils import groups

    ep_group = ps.get_expert_model_parallel_group()
    edp_group = ps.get_expert_data_parallel_group()
    name = f"ep_size_{dist.get_world_size(ep_group)}"  # DeepSpeed parses the size from the name
    tables = {
        "ep": (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, ep_group),
        "edp": (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
                edp_group),
    }
    for by_name, ranks_by_name, group in tables.values():
        by_name.clear()  # groups of an earlier layout in this process are destroyed
        ranks_by_name.clear()
        by_name[name] = group
        ranks_by_name[name] = dist.get_process_group_ranks(group)
    for p in experts:
        p.group_name = name
    return name


def mark_tensor_parallel_params(chunks: Sequence[torch.nn.Module]) -> int:
    """Tag tensor-parallel weights (and attention sinks, one per head of the rank) as
    megatron-core's own initialisation would; returns how many.

    megatron-core (0.16) sets ``tensor_model_parallel`` / ``partition_dim`` on a weight only while
    initialising it: a model built with ``perform_initialization=False`` (filled from an HF
    checkpoint) has untagged shards. DeepSpeed's grad norm counts an untagged weight on tp rank 0
    only, so at tp>1 it drops the other ranks' shards and clips with a wrong norm.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    from toolkit.parallel.grads import whole_experts_on_tp_ranks

    dims = ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0), (RowParallelLinear, 1))
    whole = whole_experts_on_tp_ranks()
    tagged = 0
    for chunk in chunks:
        for module in chunk.modules():
            dim = next((d for cls, d in dims if isinstance(module, cls)), None)
            weight = getattr(module, "weight", None)
            sinks = getattr(module, "softmax_offset", None)  # attention sinks: one per head
            if isinstance(sinks, torch.nn.Parameter) and not hasattr(sinks,
                                                                     "tensor_model_parallel"):
                sinks.tensor_model_parallel, sinks.partition_dim = True, 0
                sinks.partition_stride = 1
                tagged += 1
            if dim is not None and weight is not None and whole and getattr(module, "is_expert",
                                                                             False):
                for t in (weight, getattr(module, "bias", None)):  # replicated on every tp
                    if isinstance(t, torch.nn.Parameter):  # rank: counted once in the norm
                        t.tensor_model_parallel = False
                continue
            if dim is None or weight is None or hasattr(weight, "tensor_model_parallel"):
                continue
            weight.tensor_model_parallel = True
            weight.partition_dim = dim
            weight.partition_stride = 1
            tagged += 1
    return tagged


def _mark_pipeline_replicas(chunks: Sequence[torch.nn.Module]) -> None:
    """Count the last stage's copy of a tied embedding once in DeepSpeed's grad norm.

    megatron-core marks that copy ``shared`` (its own norm skips it); DeepSpeed skips parameters
    marked ``ds_pipe_replicated``.
    """
    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "shared", False):
                p.ds_pipe_replicated = True


# -- one step, one evaluation --------------------------------------------------------------

def _forward_step_func(loss_fn: LossFn, counts: StepCounts):
    device = runtime.device()
    # a loss that reads the output layer's values itself (distillation: vocab-parallel logits
    # [b, s, V/tp]; a reward model: its scores [b, s, 1]) instead of per-token cross-entropy
    wants_logits = bool(getattr(loss_fn, "wants_logits", False))

    def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module):
        # Every chunk reads the micro-batch (each its own iterator): the first stage its tokens,
        # the last its labels and mask, and every stage, middle and virtual ones included, the
        # position ids, which say where packed examples start (attention and RoPE restart there).
        batch: Batch = dict(next(data_iterator))
        tokens = batch["tokens"]
        if batch.get("position_ids") is None:
            batch["position_ids"] = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
        segments = segments_of(batch["position_ids"])  # on the CPU, before the CP cut
        summed = _sums_tokens(model, loss_fn, batch)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        batch = context_parallel_share(batch)  # positions are cut before RoPE sees them
        labels = batch["labels"] if model.post_process and not wants_logits else None
        output = model(batch["tokens"] if model.pre_process else None, batch["position_ids"],
                       None, labels=labels,
                       packed_seq_params=localise(segments, batch["position_ids"]),
                       **({"loss_mask": batch["loss_mask"]} if summed else {}))

        def loss_func(per_token: torch.Tensor):
            out = loss_fn(per_token, batch, counts)
            share, metrics = out if isinstance(out, tuple) else (out, {})
            # the schedule divides the returned loss in place by num_microbatches: keep a copy
            reported = {"loss": share.detach().clone(), **metrics}
            return share * counts.backward_scale, reported

        return output, loss_func

    return forward_step


def _sums_tokens(model: torch.nn.Module, loss_fn: LossFn, batch: Batch) -> bool:
    """Whether the model sums the kept tokens' losses itself (a fused linear cross-entropy,
    ``toolkit.models.kernels``) for this micro-batch; then ``batch`` gets a 0/1 ``loss_mask``
    (all ones when it had none). A weighted mask keeps the per-token path."""
    if not (getattr(model, "post_process", False) and getattr(model, "linear_ce_vocab", None)
            and getattr(loss_fn, "accepts_token_sum", False)):
        return False
    mask = batch.get("loss_mask")
    if mask is None:
        batch["loss_mask"] = torch.ones_like(batch["labels"], dtype=torch.float32)
        return True
    return bool(((mask == 0) | (mask == 1)).all())


def train_step(engine, chunks: Sequence[torch.nn.Module], data_iterator: Iterator[Batch],
               **kwargs: Any) -> StepResult:
    """:func:`run_step` with its values read at once (one step, resolved)."""
    return resolve_steps([run_step(engine, chunks, data_iterator, **kwargs)])[0]


def run_step(
    engine,
    chunks: Sequence[torch.nn.Module],
    data_iterator: Iterator[Batch],
    *,
    num_microbatches: int,
    micro_batch: int,
    seq_len: int,
    loss_fn: LossFn = token_mean,
    lr: float | None = None,
    rows_per_sample: int = 1,
) -> PendingStep:
    """Forward/backward over ``num_microbatches`` micro-batches, one reduction, one update;
    its values stay on the device until ``step_values.resolve_steps`` (no blocking read).

    ``data_iterator`` yields this rank's micro-batches as dicts of CPU tensors: ``tokens`` and
    ``labels`` ([micro_batch, seq_len] int64), optional ``loss_mask`` and ``position_ids``
    (restarting at 0 where a packed example starts). Every rank of the pipeline reads it (one
    item per micro-batch). ``loss_fn(per_token_loss, batch, counts)`` returns the micro-batch's
    share of the global batch's loss (``toolkit.train.loop.loss``; default: token-weighted mean).
    ``lr``: when given, the update uses this learning rate (a stateless LR schedule).
    ``rows_per_sample``: sequences per sample (DPO: 2, a chosen and a rejected row), so a
    micro-batch holds ``micro_batch * rows_per_sample`` rows; DeepSpeed counts samples.
    """
    chunks = list(chunks)
    _check_step_args(engine, chunks, num_microbatches, micro_batch, seq_len)
    if lr is not None:
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
    stage = engine.zero_optimization_stage()
    batches = list(data_iterator)
    counts = count_step(batches)

    def run_schedule():
        out = _schedule(chunks, batches, loss_fn, counts,
                        micro_batch=micro_batch * rows_per_sample, seq_len=seq_len,
                        forward_only=False)
        finalize_grads(chunks)
        return out

    if stage == 0:
        results = run_schedule()
        if engine.dp_world_size > 1 or engine.has_moe_layers:  # alone, nothing to reduce (and
            engine.allreduce_gradients()  # DeepSpeed would still flatten and copy every grad)
    else:
        with engine.coalesce_grad_reduction():
            results = run_schedule()
    used_lr = float(engine.get_lr()[0])
    grad_norm = _zero0_grad_norm(engine) if stage == 0 else None
    engine.step()
    if grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    names = loss_names(loss_fn)
    return PendingStep(shares=local_shares(results, num_microbatches, names), names=names,
                       grad_norm=grad_norm, lr=used_lr, skipped=not engine.was_step_applied(),
                       num_microbatches=num_microbatches, loss_tokens=counts.loss_tokens)


def evaluate(chunks: Sequence[torch.nn.Module], data_iterator: Iterator[Batch], *,
             num_microbatches: int, micro_batch: int, seq_len: int,
             loss_fn: LossFn = token_mean, loss_tokens: float | None = None,
             samples: int | None = None) -> float:
    """The loss over ``num_microbatches`` micro-batches, forward only (no gradients, no update),
    normalised over all of them at once, identical on every rank (:func:`evaluate_metrics`).
    The chunks are in eval mode meanwhile (dropout off) and back in training mode
    afterwards."""
    return evaluate_metrics(chunks, data_iterator, num_microbatches=num_microbatches,
                            micro_batch=micro_batch, seq_len=seq_len, loss_fn=loss_fn,
                            loss_tokens=loss_tokens, samples=samples)["loss"]


def evaluate_metrics(chunks: Sequence[torch.nn.Module], data_iterator: Iterator[Batch], *,
                     num_microbatches: int, micro_batch: int, seq_len: int,
                     loss_fn: LossFn = token_mean, loss_tokens: float | None = None,
                     samples: int | None = None) -> dict[str, float]:
    """:func:`evaluate` with the loss_fn's metrics too: {"loss": ..., name: ...}. ``loss_tokens``
    and ``samples`` (rows that carry loss): the counts over every data-parallel rank when the
    caller knows them (the micro-batches are then read lazily); else the micro-batches are read
    first and counted. ``micro_batch`` counts rows."""
    if loss_tokens is None or samples is None:
        batches: Iterable[Batch] = list(data_iterator)
        counts = count_step(batches)
    else:
        batches = data_iterator
        counts = dataclasses.replace(count_step([], tokens=loss_tokens, samples=samples),
                                     num_microbatches=num_microbatches)
    results = forward_outputs(chunks, batches, loss_fn, num_microbatches=num_microbatches,
                              micro_batch=micro_batch, seq_len=seq_len, counts=counts)
    return _step_metrics(results, num_microbatches, loss_fn)


def forward_outputs(chunks: Sequence[torch.nn.Module], batches: Iterable[Batch],
                    loss_fn: LossFn, *, num_microbatches: int, micro_batch: int, seq_len: int,
                    counts: StepCounts | None = None) -> list[dict[str, torch.Tensor]]:
    """The last pipeline stage's ``{"loss", **metrics}`` of each micro-batch, forward only (no
    gradients; the chunks in eval mode meanwhile, back in training mode afterwards); other
    stages get an empty list. ``micro_batch`` counts rows. ``counts``: what the loss_fn's
    shares are shares of (none for a loss_fn that only collects values)."""
    chunks = list(chunks)
    if counts is None:
        counts = StepCounts(loss_tokens=0.0, samples=0, num_microbatches=num_microbatches, dp=1)
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        results = _schedule(chunks, batches, loss_fn, counts, micro_batch=micro_batch,
                            seq_len=seq_len, forward_only=True)
    for chunk in chunks:
        chunk.train()
    return list(results)


def _schedule(chunks: list[torch.nn.Module], batches: Iterable[Batch], loss_fn: LossFn,
              counts: StepCounts, *, micro_batch: int, seq_len: int, forward_only: bool):
    """megatron-core's schedule (none, 1F1B or interleaved, from the pipeline layout) over this
    rank's chunks, each reading the micro-batches through its own iterator. Returns the last
    stage's loss dicts."""
    iterators = itertools.tee(iter(batches), len(chunks))
    return get_forward_backward_func()(
        forward_step_func=_forward_step_func(loss_fn, counts),
        data_iterator=list(iterators) if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=counts.num_microbatches,
        seq_length=seq_len, micro_batch_size=micro_batch, forward_only=forward_only,
    )


def _check_step_args(engine, chunks, num_microbatches: int, micro_batch: int,
                     seq_len: int) -> None:
    if engine.gradient_accumulation_steps() != num_microbatches:
        raise EngineError(
            f"num_microbatches={num_microbatches} but the DeepSpeed config has "
            f"gradient_accumulation_steps={engine.gradient_accumulation_steps()}: set it to "
            "global_batch / (micro_batch * dp)."
        )
    if engine.train_micro_batch_size_per_gpu() != micro_batch:
        raise EngineError(
            f"micro_batch={micro_batch} but the DeepSpeed config has "
            f"train_micro_batch_size_per_gpu={engine.train_micro_batch_size_per_gpu()}."
        )
    wrapped = [engine.module] if len(chunks) == 1 else list(engine.module)
    if len(wrapped) != len(chunks) or any(a is not b for a, b in zip(wrapped, chunks, strict=True)):
        raise EngineError("train_step got model chunks other than the ones the engine wraps.")
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp > 1 and num_microbatches % pp and len(chunks) > 1:
        raise EngineError(
            f"interleaved pipelining needs num_microbatches ({num_microbatches}) divisible by "
            f"pp ({pp}): adjust global_batch or micro_batch."
        )
    if seq_len <= 0 or micro_batch <= 0:
        raise EngineError(f"seq_len={seq_len} and micro_batch={micro_batch} must be positive.")


def _zero0_grad_norm(engine) -> torch.Tensor:
    """The norm ZeRO-0 clips with (it does not record it): reduced grads, each weight once
    (on the device: read with the step's other values)."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    total = torch.zeros(1, dtype=torch.float64, device=runtime.device())
    for p in engine.module.parameters():
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if tp_rank == 0 or getattr(p, "tensor_model_parallel", False):
            total += p.grad.detach().double().norm() ** 2
    dist.all_reduce(total, group=ps.get_model_parallel_group())
    return total.sqrt()


def _step_metrics(results: list[dict[str, torch.Tensor]], num_microbatches: int,
                  loss_fn: LossFn) -> dict[str, float]:
    """The step's loss and the loss_fn's metrics (their shares summed,
    ``loss.reduce_shares``), on every rank; the loss must be finite."""
    values = reduce_shares(results, num_microbatches, loss_names(loss_fn))
    if not math.isfinite(values["loss"]):
        raise FloatingPointError(f"training loss is {values['loss']}")
    return values
