"""Process groups from a ParallelLayout, and the ``mpu`` object DeepSpeed expects.

megatron-core's ``parallel_state`` owns the groups; ``Mpu`` only renames them into the interface
DeepSpeed calls (``get_model_parallel_*``, ``get_pipe_parallel_*``, ``get_data_parallel_*``, ...).
DeepSpeed's "model parallel" group is megatron-core's tp x pp group: gradient norms are summed over
it, and replicated parameters are counted on tensor-parallel rank 0 only.
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from toolkit import runtime
from toolkit.parallel.layout import LayoutError, ParallelLayout, ResolvedLayout


class Mpu:
    """DeepSpeed's ``mpu`` protocol over megatron-core's parallel_state."""

    def __init__(self, layout: ResolvedLayout):
        self.layout = layout

    # tensor parallel
    def get_tensor_model_parallel_group(self):
        return ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_world_size(self) -> int:
        return ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        return ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return ps.get_tensor_model_parallel_src_rank()

    # model parallel = tp x pp (megatron-core's model-parallel group)
    def get_model_parallel_group(self):
        return ps.get_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(ps.get_model_parallel_group())

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(ps.get_model_parallel_group())

    def get_model_parallel_src_rank(self) -> int:
        return ps.get_model_parallel_src_rank()

    # pipeline parallel
    def get_pipe_parallel_group(self):
        return ps.get_pipeline_model_parallel_group()

    def get_pipe_parallel_world_size(self) -> int:
        return ps.get_pipeline_model_parallel_world_size()

    def get_pipe_parallel_rank(self) -> int:
        return ps.get_pipeline_model_parallel_rank()

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank

    # data parallel: includes cp ranks, since ZeRO shards and reduces over dp*cp
    # (context-parallel ranks hold identical weights and see different tokens).
    def get_data_parallel_group(self):
        return ps.get_data_parallel_group(with_context_parallel=True)

    def get_data_parallel_world_size(self) -> int:
        return ps.get_data_parallel_world_size(with_context_parallel=True)

    def get_data_parallel_rank(self) -> int:
        return ps.get_data_parallel_rank(with_context_parallel=True)

    def get_data_parallel_rank_without_cp(self) -> int:
        """Which share of the global batch this rank reads (CP ranks of one dp rank share it)."""
        return ps.get_data_parallel_rank()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.get_data_parallel_group())

    # DeepSpeed's "sequence parallel" is Ulysses, which mdtk does not use: size 1.
    def get_sequence_parallel_world_size(self) -> int:
        return 1

    def get_sequence_parallel_rank(self) -> int:
        return 0

    def get_sequence_parallel_group(self):
        return None

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.get_data_parallel_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return self.get_data_parallel_rank()

    def get_sequence_data_parallel_group(self):
        return self.get_data_parallel_group()

    # slice parallel (DeepSpeed's name for the tensor-parallel slice used by activation ckpt)
    def get_slice_parallel_group(self):
        return self.get_tensor_model_parallel_group()

    def get_slice_parallel_world_size(self) -> int:
        return self.get_tensor_model_parallel_world_size()

    def get_slice_parallel_rank(self) -> int:
        return self.get_tensor_model_parallel_rank()

    # experts
    def get_expert_model_parallel_group(self):
        return ps.get_expert_model_parallel_group()

    def get_expert_data_parallel_group(self):
        return ps.get_expert_data_parallel_group()


def check_supported(layout: ParallelLayout) -> None:
    """Refuse layouts this installation cannot run, before any process group is made.

    Context parallelism runs without Transformer Engine since mdtk's own CP attention
    (``toolkit.models.cp_attention``); what it cannot compute (sliding windows, non-causal
    masks, learnable softmax offsets) is refused when the model is built, naming the feature.
    Nothing else is refused here yet: the hook stays so the trainer checks before any group.
    """
    del layout


def initialize(layout: ParallelLayout, *, seed: int = 1234) -> Mpu:
    """Set up megatron-core's process groups for ``layout`` on the current world.

    torch.distributed is initialised from the environment if it is not yet (torchrun, deepspeed
    launcher, srun). The layout is resolved against the real world size here, so a launch with
    the wrong number of ranks fails before any model is built.
    """
    check_supported(layout)
    runtime.enable_cpu_mode()
    runtime.init_distributed()
    layout = layout.resolve(dist.get_world_size())
    if ps.model_parallel_is_initialized():
        raise LayoutError(
            "megatron-core parallel state is already initialised: call toolkit.parallel.destroy() "
            "before initialising another layout in the same process."
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp and layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=False,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Mpu(layout)


def destroy() -> None:
    """Tear down megatron-core's groups (torch.distributed stays up for the next layout).

    megatron-core only forgets its groups; the process groups themselves (gloo: two threads
    each once used) live on. A process that tries several layouts would accumulate thousands
    of threads, so every group except WORLD is destroyed here, and DeepSpeed's caches of them
    are released.
    """
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if not dist.is_initialized():
        return
    # megatron-core 0.16.1's destroy_model_parallel misses some of its globals (e.g.
    # _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP): a group still named there outlives its
    # destruction below with its gloo threads (~3 per layout run, each waking 100 times a second)
    for name, value in list(vars(ps).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    _clear_rotary_caches()
    moe = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe is not None:  # its aux-loss tracker keeps each loss's reduce group
        moe.get_moe_layer_wise_logging_tracker().clear()
    from torch.distributed import distributed_c10d as c10d

    ds_groups = sys.modules.get("deepspeed.utils.groups")
    for pg in list(c10d._world.pg_map):
        if pg is c10d.GroupMember.WORLD:
            continue
        dist.destroy_process_group(pg)
        if ds_groups is not None:
            ds_groups._release_process_group_references(pg)
    if ds_groups is not None:
        # DeepSpeed also keeps the last engine's mpu (``groups.mpu``, set by every engine built
        # with one): left pointing at the groups just destroyed, a later engine built without
        # an mpu would ask it for a data-parallel group that no longer exists.
        ds_groups.mpu = None


_ROTARY = ("megatron.core.models.common.embeddings.rotary_pos_embedding",
           "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")


def _clear_rotary_caches() -> None:
    """megatron-core memoizes rotary embeddings' ``forward`` with ``lru_cache`` on the method:
    the cache keeps each model's rotary module, and with it its CP group, for the life of the
    process (one destroyed group's gloo threads per layout run)."""
    for name in _ROTARY:
        module = sys.modules.get(name)
        for cls in (v for v in vars(module).values() if isinstance(v, type)) if module else ():
            for attr in vars(cls).values():
                if callable(getattr(attr, "cache_clear", None)):
                    attr.cache_clear()
