"""YaRN RoPE in megatron-core's ``GPTModel`` (``position_embedding_type='yarn'``): its config.

megatron-core 0.16.1 builds ``GPTModel``'s ``YarnRotaryEmbedding`` from ``yarn_*`` attributes of
the TransformerConfig, and its attention multiplies cos / sin by the YaRN concentration factor
read from the same attributes (``_yarn_get_concentration_factor_from_config``), but
``TransformerConfig`` declares none of them (Megatron-Bridge adds them on its model providers).
``YarnTransformerConfig`` declares them as fields, so they survive ``dataclasses.replace`` (the
virtual-pipeline copy in ``build_chunks``). The values come from the HF config through
``toolkit.adapters.hfconfig.yarn_kwargs``; ``yarn_mscale`` / ``yarn_mscale_all_dim`` None means
HF's ``get_mscale(factor)``, as both libraries compute it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """TransformerConfig with the YaRN fields megatron-core's GPTModel reads."""

    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    yarn_correction_range_round_to_int: bool = True
