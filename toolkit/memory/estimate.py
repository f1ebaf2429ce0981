"""Per-rank memory of one training setup: model states + DeepSpeed buffers + activations.

``estimate`` evaluates every pipeline stage and reports the one that needs the most GPU memory
(the first stage holds the most in-flight micro-batches; the last holds the logits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from toolkit import rules
from toolkit.memory.activations import TrainShape, activation_bytes
from toolkit.memory.model import ModelShape
from toolkit.memory.states import (
    CPU,
    DTYPE_BYTES,
    GPU,
    NVME,
    Item,
    RankParams,
    ZeroOptions,
    buffer_items,
    checkpoint_staging_item,
    model_state_items,
    rank_params,
    reference_items,
    uses_megatron,
)
from toolkit.parallel.layout import LayoutError, ResolvedLayout

GIB = 1024**3
ACTIVATION_LINES = ("activations", "recompute", "final norm", "loss")
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": GIB, "T": 1024**4}


def parse_bytes(text: str | int | float) -> int:
    """'80GB', '80G', '80GiB', '1TB', '512MB' or a number of bytes (units are binary)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"cannot read the size {text!r}: write it like 80GB, 512MB or 1TB.")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class Cluster:
    """The machines a job runs on. Memory sizes in bytes."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem: int = 80 * GIB
    cpu_mem: int = 1024 * GIB  # per node
    nvme_path: str | None = None
    nvme_size: int | None = None  # per node; None = unknown (assumed large enough)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"nodes={self.nodes} and gpus_per_node={self.gpus_per_node} must be "
                             ">= 1.")
        if self.gpu_mem <= 0 or self.cpu_mem <= 0:
            raise ValueError("gpu_mem and cpu_mem must be positive sizes.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Estimate:
    """One rank's breakdown (the worst pipeline stage) and the totals per device."""

    items: tuple[Item, ...]
    stage: int  # the pipeline stage shown
    params: RankParams
    layout: ResolvedLayout
    zero: ZeroOptions
    train: TrainShape
    num_microbatches: int

    def total(self, device: str, *, peak: bool = True) -> int:
        return sum(i.bytes for i in self.items
                   if i.device == device and (peak or not i.transient))

    @property
    def gpu(self) -> int:
        return self.total(GPU)

    @property
    def cpu(self) -> int:
        return self.total(CPU)

    @property
    def nvme(self) -> int:
        return self.total(NVME)

    def model_states(self, *, peak: bool = False, device: str | None = None) -> int:
        """Parameters, gradients, optimizer states and buffers (on one device or all);
        ``peak`` adds the transient ones."""
        return sum(i.bytes for i in self.items
                   if not is_activation(i) and (peak or not i.transient)
                   and device in (None, i.device))

    def activations(self) -> int:
        return sum(i.bytes for i in self.items if is_activation(i))

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.describe(), "zero_stage": self.zero.stage,
            "offload_optimizer": self.zero.offload_optimizer,
            "offload_param": self.zero.offload_param,
            "pipeline_stage": self.stage, "params_on_rank": self.params.total,
            "num_microbatches": self.num_microbatches,
            "items": [dict(what=i.what, device=i.device, bytes=i.bytes, transient=i.transient,
                           note=i.note) for i in self.items],
            "total_bytes": {GPU: self.gpu, CPU: self.cpu, NVME: self.nvme},
        }


def is_activation(item: Item) -> bool:
    return item.what.startswith(ACTIVATION_LINES)


def num_microbatches(train: TrainShape, dp: int) -> int:
    """Gradient-accumulation steps: global = micro * accumulation * dp must hold exactly."""
    if train.global_batch is None:
        return 1
    per_step = train.micro_batch * dp
    if train.global_batch % per_step:
        raise LayoutError(
            f"global batch {train.global_batch} is not divisible by micro_batch * dp = "
            f"{train.micro_batch} * {dp} = {per_step}: choose a global batch that is a multiple "
            f"of {per_step}."
        )
    return train.global_batch // per_step


def teacher_items(train: TrainShape, layout: ResolvedLayout, zero: ZeroOptions, stage: int,
                  num_microbatches: int) -> list[Item]:
    """Distillation's frozen teacher at the student's layout: its weights on this rank (as a
    reference model's, ZeRO-3 partitioned like the student), and on the last stage its logits
    of the step's micro-batches (this rank's vocab columns and sequence part, in the run's
    dtype), held until the student's schedule has read them."""
    teacher = train.teacher
    assert teacher is not None
    params = rank_params(teacher, layout, stage, zero.param_persistence_threshold
                         if zero.stage == 3 else 0)
    items = reference_items(params, zero, train.dtype, name="teacher model")
    if stage == layout.pp - 1:
        vocab = teacher.padded_vocab(layout.tp) if uses_megatron(layout) else teacher.vocab
        logits = (num_microbatches * train.rows * (train.seq_len // layout.cp)
                  * (vocab // layout.tp) * DTYPE_BYTES[train.dtype])
        items.append(Item("teacher logits of one step", GPU, logits, transient=True))
    return items


def kv_cache_bytes(model: ModelShape, layers: tuple[int, ...], tp: int, rows: int, tokens: int,
                   dtype: str) -> int:
    """What megatron-core 0.16.1's ``StaticInferenceContext`` holds once a static batch has run:
    each attention layer of this rank allocates (``Attention._allocate_memory``) a key and a
    value buffer of ``[tokens, rows, query groups per tp rank, head size]`` in the model's dtype
    and keeps them for the context's life. Query groups per rank: kv_heads / tp, at least one
    (kv_heads < tp: each rank holds one group); multi-latent attention caches every head's
    whole key (nope + rope) and value. Gated DeltaNet layers keep no KV cache."""
    if model.kv_lora:
        groups, width = model.heads // tp, model.qk_nope + model.qk_rope + model.head_dim
    else:
        groups, width = max(1, model.kv_heads // tp), 2 * model.head_dim
    attention = [i for i in layers if i not in model.delta_layers]
    return len(attention) * tokens * rows * groups * width * DTYPE_BYTES[dtype]


def vllm_reserve(share: float, gpu_mem: int) -> int:
    """Device memory a colocated vLLM engine holds (``grpo.vllm_gpu_memory_utilization``: its
    weights, KV cache and activations) and the DeepSpeed sizing keeps free: its share of the
    device. mdtk's own rollout KV cache (``rollout_cache_item``) is then not counted."""
    return int(share * gpu_mem)


@dataclass(frozen=True)
class VllmFit:
    """A vLLM engine of tensor parallelism ``tp`` in its share of each device: its weights per
    device (the model / tp) and what the share leaves for its KV cache, in tokens."""

    tp: int
    weights: int
    kv_tokens: int  # 0: the weights alone fill the share

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0


def vllm_fits(model: ModelShape, share: float, gpu_mem: int, dtype: str,
              sizes: tuple[int, ...]) -> list[VllmFit]:
    """``grpo.vllm_tensor_parallel_size`` candidates (``sizes``) for a colocated engine holding
    ``share`` of each device (``vllm_reserve``): vLLM shards its weights and KV cache over its
    tp ranks; the KV cache takes what the share leaves (activations and CUDA graphs aside)."""
    room, layers = vllm_reserve(share, gpu_mem), tuple(range(model.layers))
    out = []
    for tp in sizes:
        weights = model.num_params() * DTYPE_BYTES[dtype] // tp
        token = max(1, kv_cache_bytes(model, layers, tp, 1, 1, dtype))  # 0: no attention layer
        out.append(VllmFit(tp, weights, max(0, room - weights) // token))
    return out


def rollout_cache_item(model: ModelShape, train: TrainShape, layout: ResolvedLayout,
                       params: RankParams) -> Item:
    """GRPO's generation engine on the training ranks (``infer.Generator``): one static batch
    of this rank's rows of the global batch (global / dp completions), ``seq_len + 1`` tokens
    each (prompt + completion), its KV cache held for the whole run (the engine keeps its
    context between generation batches)."""
    global_batch = train.global_batch or train.micro_batch * layout.dp
    rows, tokens = global_batch // layout.dp, train.seq_len + 1
    nbytes = kv_cache_bytes(model, params.layers, layout.tp, rows, tokens, train.dtype)
    return Item(f"rollout KV cache ({rows} rows x {tokens} tokens)", GPU, nbytes,
                note="GRPO's generation engine")


def estimate(model: ModelShape, train: TrainShape, layout: ResolvedLayout, zero: ZeroOptions,
             pipeline_stage: int | None = None) -> Estimate:
    """The per-rank memory of ``pipeline_stage``, by default of the stage (first or last) that
    needs the most GPU memory. ZeRO-2/3 with pp > 1 are refused (``toolkit.rules``; clipping is
    not the memory model's to know, so ZeRO-0 is estimated)."""
    layout.validate_model(num_layers=model.layers, num_heads=model.heads,
                          num_query_groups=model.kv_heads, num_experts=model.experts or None,
                          vocab_size=model.vocab, ffn_hidden_size=model.ffn,
                          seq_len=train.seq_len)
    problem = rules.zero_with_pipeline(zero.stage, layout.pp, clipping=False)
    if problem:
        raise LayoutError(problem)
    m = num_microbatches(train, layout.dp)
    candidates = []
    stages = sorted({0, layout.pp - 1}) if pipeline_stage is None else [pipeline_stage]
    if not all(0 <= st < layout.pp for st in stages):
        raise LayoutError(f"pipeline_stage={pipeline_stage} is outside 0..{layout.pp - 1}.")
    for stage in stages:
        params = rank_params(model, layout, stage, zero.param_persistence_threshold
                             if zero.stage == 3 else 0)
        items = model_state_items(params, zero, train.dtype) + buffer_items(
            params, zero, train.dtype)
        if train.reference_model and not params.frozen:  # LoRA: the policy, adapters off
            items += reference_items(params, zero, train.dtype)
        if train.rollout_cache:
            items.append(rollout_cache_item(model, train, layout, params))
        if train.teacher is not None:
            items += teacher_items(train, layout, zero, stage, m)
        if train.async_checkpoint:
            items.append(checkpoint_staging_item(params, zero, train.dtype))
        for what, nbytes in activation_bytes(model, train, layout, params, stage, m).items():
            items.append(Item(what, GPU, int(nbytes), transient=not what.startswith(
                "activations")))
        candidates.append(Estimate(tuple(items), stage, params, layout, zero, train, m))
    return max(candidates, key=lambda e: e.gpu)
