"""LoRA / DoRA adapters on megatron-core layers (torch-free exports only: see the modules)."""

from toolkit.lora.spec import LoraError, LoraSpec

__all__ = ["LoraError", "LoraSpec"]
