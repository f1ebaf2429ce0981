"""Gradient reductions that megatron-core's layout needs beyond data parallelism.

megatron-core leaves these to its own DDP wrapper (``finalize_model_grads``); mdtk trains with
DeepSpeed instead, so it does them here, on ``param.grad``, before the optimizer sees the grads:
- weights replicated across tensor-parallel ranks whose inputs differ per rank (norms under
  sequence parallelism, the MoE router under SP, q/k norms that see a rank's heads only, LoRA
  tensors marked ``tp_partial_grad``): sum over the TP group;
- input embedding and output layer tied across the first and last pipeline stage: sum over the
  embedding group;
- expert weights not split over tp (expert-TP 1 < TP, no expert parallelism): each tp rank runs
  the whole experts on its part of the tokens (sequence parallelism), so like the norms their
  grads are summed over the TP group; DeepSpeed then treats them as the replicated weights they
  are (reduced over data parallelism, counted once in the grad norm).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def _needs_tp_sum(name: str, param: torch.nn.Parameter, sequence_parallel: bool,
                  whole_experts: bool = False) -> bool:
    if sequence_parallel and getattr(param, "sequence_parallel", False):
        return True
    if whole_experts and ".experts." in f".{name}":
        return True
    if getattr(param, "tp_partial_grad", False):  # e.g. LoRA adapters (toolkit.lora.layers)
        return True
    return "q_layernorm" in name or "k_layernorm" in name


def whole_experts_on_tp_ranks() -> bool:
    """Expert-TP 1 below TP without expert parallelism: every tp rank holds all experts."""
    if not ps.model_parallel_is_initialized():
        return False
    return (ps.get_expert_tensor_parallel_world_size() == 1
            and ps.get_expert_model_parallel_world_size() == 1
            and ps.get_tensor_model_parallel_world_size() > 1)


def tp_replicated_grads(chunks: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Grads of the TP-replicated weights whose grads must be summed over TP."""
    grads = []
    whole = whole_experts_on_tp_ranks()
    for chunk in chunks:
        sp = bool(getattr(chunk.config, "sequence_parallel", False))
        for name, p in chunk.named_parameters():
            if p.grad is not None and _needs_tp_sum(name, p, sp, whole):
                grads.append(p.grad)
    return grads


def finalize_grads(chunks: list[torch.nn.Module]) -> None:
    """Apply the TP and embedding reductions to the ``.grad`` of every chunk of this rank."""
    if ps.get_tensor_model_parallel_world_size() > 1:
        grads = tp_replicated_grads(chunks)
        if grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads),
                                 strict=True):
                g.copy_(synced)
    _sum_tied_embedding_grads(chunks)


def _sum_tied_embedding_grads(chunks: list[torch.nn.Module]) -> None:
    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group(
        ignore_virtual=True
    ):
        return
    first, last = chunks[0], chunks[-1]
    if ps.is_pipeline_first_stage(ignore_virtual=True):
        chunk = first
    elif ps.is_pipeline_last_stage(ignore_virtual=True):
        chunk = last
    else:
        return
    if not getattr(chunk, "share_embeddings_and_output_weights", False):
        return
    weight = chunk.shared_embedding_or_output_weight()
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=ps.get_embedding_group())
