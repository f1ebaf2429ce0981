"""What this rank holds of a live model: its coordinate in the layout and its chunks' weights.

Shared by live loading / export (``live``) and the weight stream (``stream``), so both read a
rank's position and its tensors the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.mapping import Coord

#: Persistent buffers that are checkpoint weights (DeepSeek's ``e_score_correction_bias``).
WEIGHT_BUFFERS = ("mlp.router.expert_bias",)


def current_coord() -> Coord:
    """This rank's position, read from megatron-core's parallel state."""
    from megatron.core import parallel_state as ps

    return Coord(
        tp_rank=ps.get_tensor_model_parallel_rank(), tp=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        ep_rank=ps.get_expert_model_parallel_rank(), ep=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
    )


def chunk_params(chunks: list[Any]) -> dict[tuple[int, str], torch.Tensor]:
    """The chunks' parameters and weight buffers (``WEIGHT_BUFFERS``), by (chunk, name)."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    for i, chunk in enumerate(chunks):
        out.update(((i, n), p) for n, p in chunk.named_parameters())
        out.update(((i, n), b) for n, b in chunk.named_buffers() if n.endswith(WEIGHT_BUFFERS))
    return out
