"""The project's megatron-core building blocks: layer spec, CPU-safe config, model chunks."""

from toolkit.models.build import block_spec, build_chunks, layer_spec, transformer_config
from toolkit.models.norm import TorchNorm

__all__ = ["TorchNorm", "block_spec", "build_chunks", "transformer_config", "layer_spec"]
