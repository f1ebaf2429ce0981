"""Model-state bytes per rank: parameters, gradients, optimizer states and DeepSpeed's buffers.

The layouts follow what DeepSpeed 0.19 allocates (checked by measuring real engines, see
tests/dist_checks/memory_checks.py):

- stage 0: everything replicated; mixed precision keeps an fp32 master copy (FP16_Optimizer /
  FP16_UnfusedOptimizer), fp32 training updates the parameters in place (no master copy).
- stage 1: fp32 master + Adam m, v sharded over the data-parallel group. DeepSpeed 0.19 runs
  stage 1 through the stage-2 code: gradients are reduced into a 1/dp partition during backward.
- stage 2: the same memory as stage 1, gradients reduced through ``reduce_bucket_size`` buckets.
- stage 3: parameters sharded too; small tensors (< ``stage3_param_persistence_threshold``)
  stay whole on every rank; the layer being computed is gathered (transient).
- at stage >= 1 DeepSpeed keeps an fp32 master partition even when training in fp32.
- optimizer offload moves master, m, v and an fp32 gradient partition to host (cpu) or the
  master, m, v to NVMe (host keeps swap buffers); parameter offload moves the 16-bit partitions.
  Stage 1/2 offload keeps a 16-bit staging partition of the updated parameters and two gradient
  staging buffers of the largest tensor's size on the GPU; stage 3 keeps its gradient partition.
- ZeRO++ (stage 3): hpZ keeps a secondary copy of the parameters sharded over its group of
  ``hpz`` ranks (``ds_secondary_tensor``: 1/hpz of every partitioned tensor, from the first
  forward of a step until the optimizer step frees it); qwZ gathers int8 (a receive buffer and
  an fp16 dequantized copy of what is gathered); qgZ reduces int4 (buffers of one bucket).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from toolkit import rules
from toolkit.checkpoint.torchfree.dtypes import PRECISIONS
from toolkit.memory.model import EXPERT, REP, ModelShape
from toolkit.parallel.layout import ParallelLayout, ResolvedLayout

GPU, CPU, NVME = "gpu", "cpu", "nvme"
ADAM_STATE_BYTES = 8  # fp32 exp_avg + exp_avg_sq
MASTER_BYTES = 4  # fp32 master weights
DTYPE_BYTES = {name: d.itemsize for name, d in PRECISIONS.items()}


@dataclass(frozen=True)
class ZeroOptions:
    """The DeepSpeed ``zero_optimization`` settings the memory model depends on."""

    stage: int = 0
    offload_optimizer: str = "none"  # none / cpu / nvme
    offload_param: str = "none"  # none / cpu / nvme (stage 3 only)
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    optimizer_buffer_count: int = 4
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    overlap_comm: bool = True
    hpz: int = 1  # zero_hpz_partition_size: ranks of hpZ's secondary partition (1: off)
    quantized_weights: bool = False  # zero_quantized_weights (qwZ)
    quantized_gradients: bool = False  # zero_quantized_gradients (qgZ)

    @property
    def zeropp(self) -> bool:
        """Any ZeRO++ option on."""
        return self.hpz > 1 or self.quantized_weights or self.quantized_gradients

    def __post_init__(self) -> None:
        if self.stage not in rules.ZERO_STAGES:
            raise ValueError(f"ZeRO stage {self.stage!r} does not exist: use 0, 1, 2 or 3.")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in rules.OFFLOAD_DEVICES:
                raise ValueError(f"{name}={getattr(self, name)!r}: use none, cpu or nvme.")
        offload = rules.offload_problems(self.stage, self.offload_optimizer, self.offload_param)
        if offload:
            raise ValueError(f"offload_optimizer={self.offload_optimizer}, offload_param="
                             f"{self.offload_param}: {offload[0][1]}")
        if self.hpz < 1:
            raise ValueError(f"hpz={self.hpz}: the hpZ partition size is >= 1 (1 = off).")
        if self.zeropp and (problem := rules.zeropp_stage_problem(self.stage)):
            raise ValueError(problem)


@dataclass(frozen=True)
class Item:
    """One line of a memory breakdown. ``transient`` lines exist only at a moment of the step
    (gathered layer, bucket being reduced): they count for the peak, not for a snapshot."""

    what: str
    device: str
    bytes: int
    transient: bool = False
    note: str = ""


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one model-parallel rank (before ZeRO sharding)."""

    dense: int  # sharded over dp*cp by ZeRO
    expert: int  # sharded over the expert-data-parallel group
    dense_dp: int
    expert_dp: int
    persistent: int  # stage-3 tensors kept whole (numel below the persistence threshold)
    largest_layer: int  # one decoder layer on this rank: what stage 3 gathers at once
    largest_tensor: int
    layers: tuple[int, ...] = field(default=())
    frozen: int = 0  # LoRA: the base weights (no gradients, no optimizer states)

    @property
    def total(self) -> int:
        """Trainable parameters (all of them without LoRA)."""
        return self.dense + self.expert


def uses_megatron(layout: ParallelLayout) -> bool:
    """Any model parallelism means megatron-core builds the model (padded vocabulary)."""
    return layout.tp * layout.pp * layout.cp * layout.ep > 1


def stage_layers(model: ModelShape, layout: ParallelLayout, stage: int) -> tuple[int, ...]:
    """Decoder layers held by pipeline rank ``stage`` (interleaved: every pp-th chunk)."""
    chunks = layout.pp * (layout.vpp or 1)
    per_chunk = model.layers // chunks
    return tuple(
        layer
        for chunk in range(stage, chunks, layout.pp)
        for layer in range(chunk * per_chunk, (chunk + 1) * per_chunk)
    )


@lru_cache(maxsize=4096)
def rank_params(model: ModelShape, layout: ResolvedLayout, stage: int = 0,
                persistence_threshold: int = 0) -> RankParams:
    """Count this pipeline stage's parameters on one tp/ep rank, split the megatron-core way.
    Remembered (all three types are frozen): the planner asks for the same model and layout
    once per candidate setting, and each count walks every tensor of the model."""
    tp, etp = layout.tp, layout.expert_tp
    vocab = model.padded_vocab(tp) if uses_megatron(layout) else model.vocab
    layers = set(stage_layers(model, layout, stage))
    first, last = stage == 0, stage == layout.pp - 1
    dense = expert = frozen = persistent = largest_tensor = 0
    per_layer: dict[int, int] = {}
    for t in model.tensors(vocab=vocab):
        if t.layer is None:
            held = (t.name in ("embed", "pos_embed") and first) or (
                t.name in ("final_norm", "lm_head") and last)
            if t.name == "embed" and model.tied and last and not first:
                held = True  # megatron-core keeps a copy of the tied output weight
            if not held:
                continue
        elif t.layer not in layers:
            continue
        if t.split == EXPERT:
            n = t.numel // (layout.ep * etp)
        else:
            n = t.numel if t.split == REP else t.numel // tp
        if not t.trainable:
            frozen += n
        elif t.split == EXPERT:
            expert += n
        else:
            dense += n
        if t.layer is not None:
            per_layer[t.layer] = per_layer.get(t.layer, 0) + n
        if n < persistence_threshold:
            persistent += n
        local_experts = max(1, model.experts // layout.ep)
        if t.trainable:
            largest_tensor = max(largest_tensor, n // local_experts if t.split == EXPERT else n)
    dense_dp = layout.dp_cp
    expert_dp = max(1, dense_dp * tp // (layout.ep * etp))
    if layout.experts_whole_on_tp_ranks:  # the trainer reduces them like replicated dense
        expert_dp = dense_dp  # weights (toolkit.parallel.grads)
    return RankParams(dense=dense, expert=expert, dense_dp=dense_dp, expert_dp=expert_dp,
                      persistent=persistent, largest_layer=max(per_layer.values(), default=0),
                      largest_tensor=largest_tensor, layers=tuple(sorted(layers)), frozen=frozen)


def model_state_items(params: RankParams, zero: ZeroOptions, dtype: str) -> list[Item]:
    """Per-rank bytes of parameters, gradients, master weights and Adam states (+ buffers)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: use bf16, fp16 or fp32.")
    lp = DTYPE_BYTES[dtype]
    mixed = dtype != "fp32"
    s = zero.stage
    items: list[Item] = frozen_items(params, zero, dtype)
    groups = [("", params.dense, params.dense_dp), ("expert ", params.expert, params.expert_dp)]
    for prefix, n, dp in groups:
        if n == 0:
            continue
        shard = -(-n // dp) if s >= 1 else n
        # parameters
        if s == 3:
            p_dev = GPU if zero.offload_param == "none" else zero.offload_param
            items.append(Item(f"{prefix}parameters ({dtype}, 1/{dp} shard)", p_dev, lp * shard))
            if prefix == "" and params.persistent:
                items.append(Item("persistent small parameters (whole)", GPU,
                                  lp * params.persistent, note="below persistence threshold"))
        else:
            items.append(Item(f"{prefix}parameters ({dtype})", GPU, lp * n))
        # gradients: stage 1 reduces them into the partition during backward like stage 2
        if s == 0:
            items.append(Item(f"{prefix}gradients ({dtype})", GPU, lp * n))
        elif s == 3 or zero.offload_optimizer == "none":
            items.append(Item(f"{prefix}gradients ({dtype}, 1/{dp} shard)", GPU, lp * shard))
        else:
            items.append(Item(f"{prefix}updated-parameter staging partition (offload)", GPU,
                              lp * shard))
        # optimizer
        master = MASTER_BYTES if (mixed or s >= 1) else 0
        opt_dev = GPU if zero.offload_optimizer == "none" else zero.offload_optimizer
        sfx = f", 1/{dp} shard" if s >= 1 else ""
        if master:
            items.append(Item(f"{prefix}fp32 master weights{sfx}", opt_dev, master * shard))
        items.append(Item(f"{prefix}Adam m, v (fp32{sfx})", opt_dev, ADAM_STATE_BYTES * shard))
        if zero.offload_optimizer != "none":
            items.append(Item(f"{prefix}fp32 gradient partition (offload)", CPU, 4 * shard))
        elif s >= 1 or mixed:
            # made from the 16-bit gradients for the optimizer step, freed after it
            sub = min(shard, zero.sub_group_size) if s == 3 else shard
            items.append(Item(f"{prefix}fp32 gradients for the step", GPU, 4 * sub,
                              transient=True))
    return items


def reference_items(params: RankParams, zero: ZeroOptions, dtype: str,
                    name: str = "reference model") -> list[Item]:
    """A frozen model beside the policy (DPO's and KTO's reference: the policy's tensors on
    this rank; distillation's teacher: its own), weights only (no gradients or optimizer
    states). Replicated over the data-parallel group, or at stage 3 partitioned like the policy
    (a DeepSpeed engine without optimizer: a 1/dp shard of every tensor plus the whole small
    ones, on the parameter-offload device when there is one)."""
    lp = DTYPE_BYTES[dtype]
    what = f"{name} (frozen, {dtype})"
    if zero.stage != 3:
        return [Item(what, GPU, lp * params.total)]
    shard = -(-params.dense // params.dense_dp) + -(-params.expert // params.expert_dp)
    device = GPU if zero.offload_param == "none" else zero.offload_param
    items = [Item(f"{what}, 1/{params.dense_dp} shard", device, lp * shard)]
    if params.persistent:
        items.append(Item(f"{what}, persistent small parameters (whole)", GPU,
                          lp * params.persistent, note="below persistence threshold"))
    return items


def checkpoint_staging_item(params: RankParams, zero: ZeroOptions, dtype: str) -> Item:
    """Host memory of asynchronous checkpoints (the trainer's ``checkpoint.async``): a copy of
    what the worst rank writes, kept for the run. Data-parallel rank 0 writes the module state
    (16-bit parameters; its own shard at stage 3) besides its optimizer partition (fp32 master
    weights + Adam m, v; all of them at stage 0)."""
    lp = DTYPE_BYTES[dtype]
    total = 0
    for n, dp in ((params.dense, params.dense_dp), (params.expert, params.expert_dp)):
        shard = -(-n // dp) if zero.stage >= 1 else n
        master = MASTER_BYTES if (dtype != "fp32" or zero.stage >= 1) else 0
        total += lp * (shard if zero.stage == 3 else n) + (master + ADAM_STATE_BYTES) * shard
    return Item("checkpoint staging (async save: host copy of the rank's files)", CPU, total)


def frozen_items(params: RankParams, zero: ZeroOptions, dtype: str) -> list[Item]:
    """LoRA's frozen base weights: in the training dtype, without gradients, fp32 master copies or
    optimizer states; ZeRO-3 partitions them like every other parameter."""
    if not params.frozen:
        return []
    lp = DTYPE_BYTES[dtype]
    if zero.stage == 3:
        device = GPU if zero.offload_param == "none" else zero.offload_param
        shard = -(-params.frozen // params.dense_dp)
        return [Item(f"frozen base parameters ({dtype}, 1/{params.dense_dp} shard)", device,
                     lp * shard)]
    return [Item(f"frozen base parameters ({dtype})", GPU, lp * params.frozen)]


def buffer_items(params: RankParams, zero: ZeroOptions, dtype: str) -> list[Item]:
    """DeepSpeed's communication buffers and stage-3 working set."""
    lp = DTYPE_BYTES[dtype]
    s = zero.stage
    total = params.total
    items: list[Item] = []
    if s in (1, 2) and zero.offload_optimizer != "none":
        items.append(Item("gradient staging buffers (offload)", GPU,
                          2 * lp * params.largest_tensor, note="2 x largest tensor"))
    if s in (1, 2) and max(params.dense_dp, params.expert_dp) > 1:
        items.append(Item("reduce bucket (ipg buffer)", GPU,
                          lp * min(zero.reduce_bucket_size, total), transient=True))
        items.append(Item("allgather bucket (after step)", GPU,
                          lp * min(zero.allgather_bucket_size, total), transient=True))
    if s == 3:  # allocated whole at engine start (contiguous_gradients, the generator's
        # setting), however few parameters train: a LoRA run's adapters fill a sliver of it
        items.append(Item("reduce bucket (ipg buffer)", GPU, lp * zero.reduce_bucket_size))
        gathered = min(zero.max_live_parameters,
                       params.largest_layer + zero.prefetch_bucket_size, total + params.frozen)
        items.append(Item("gathered layer + prefetch", GPU, lp * gathered, transient=True,
                          note="stage3_max_live_parameters bounds it"))
        if zero.offload_param == NVME:
            items.append(Item("parameter swap buffers (pinned)", CPU,
                              lp * zero.param_buffer_count * zero.param_buffer_size))
        items += zeropp_items(params, zero, dtype, gathered)
    if zero.offload_optimizer == NVME:
        shard = -(-total // max(1, params.dense_dp))
        sub = min(zero.sub_group_size, shard)
        items.append(Item("optimizer swap buffers (pinned)", CPU,
                          4 * zero.optimizer_buffer_count * sub,
                          note="buffer_count x sub_group_size fp32"))
    return items


def zeropp_items(params: RankParams, zero: ZeroOptions, dtype: str, gathered: int) -> list[Item]:
    """ZeRO++'s memory (DeepSpeed 0.19 ``partition_parameters.py``, ``coalesced_collectives.py``).
    hpZ: the secondary partition, 1/hpz of every partitioned (non-persistent) tensor in the
    parameter dtype, on the GPU (with parameter offload: on the host) from the first forward of
    a step to the optimizer step. qwZ: the int8 receive buffer of the gathered parameters and
    their fp16 dequantized flat copy (the kernel works in fp16; each parameter is copied out of
    it in the training dtype).
    qgZ: int4 send and receive buffers of one reduce bucket."""
    lp = DTYPE_BYTES[dtype]
    items: list[Item] = []
    if zero.hpz > 1:
        device = GPU if zero.offload_param == "none" else zero.offload_param
        partitioned = params.dense - params.persistent
        items.append(Item(f"hpZ secondary parameter partition ({dtype}, 1/{zero.hpz})", device,
                          lp * -(-partitioned // zero.hpz),
                          note="zero_hpz_partition_size; freed at each optimizer step"))
    if zero.quantized_weights:
        items.append(Item("qwZ int8 gather buffer + fp16 dequantized copy", GPU, 3 * gathered,
                          transient=True, note="zero_quantized_weights"))
    if zero.quantized_gradients:
        items.append(Item("qgZ int4 all-to-all buffers (one bucket)", GPU,
                          min(zero.reduce_bucket_size, params.total), transient=True,
                          note="zero_quantized_gradients: 2 x 0.5 bytes per element"))
    return items
