"""Memory model (pure functions): what one rank holds while training, in bytes."""

from toolkit.memory.activations import TrainShape, dpo_fields
from toolkit.memory.estimate import (
    GIB,
    Cluster,
    Estimate,
    VllmFit,
    estimate,
    num_microbatches,
    parse_bytes,
    vllm_fits,
    vllm_reserve,
)
from toolkit.memory.model import ModelConfigError, ModelShape, load_model_shape, model_shape_from_hf
from toolkit.memory.states import CPU, GPU, NVME, Item, ZeroOptions, rank_params

__all__ = [
    "CPU", "GIB", "GPU", "NVME", "Cluster", "Estimate", "Item", "ModelConfigError", "ModelShape",
    "TrainShape", "ZeroOptions", "dpo_fields", "estimate", "load_model_shape",
    "model_shape_from_hf",
    "num_microbatches", "parse_bytes", "rank_params", "VllmFit", "vllm_fits", "vllm_reserve",
]
