"""Build megatron-core GPT model chunks for the calling rank from a TransformerConfig.

Families (model_adapters/) translate an HF config into a TransformerConfig plus GPTModel keyword
arguments; this module turns those into the chunks this rank owns (one per virtual pipeline
stage), always with the same layer spec, so every family runs the same code on CPU and GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_mlp_module_spec,
)
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from toolkit import runtime
from toolkit.models import delta_net, gemma, llama4, mla
from toolkit.models.attention import core_attention
from toolkit.models.gpt import GPTModel
from toolkit.models.kernels import Kernels
from toolkit.models.norm import TorchNorm
from toolkit.models.yarn import YarnTransformerConfig

# Fused kernels that need CUDA (or apex / Transformer Engine). Off by default everywhere: mdtk
# builds with the local spec, whose unfused paths are numerically the HF reference's.
_UNFUSED = dict(
    gradient_accumulation_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
)


def transformer_config(kernels: Kernels | None = None, **kwargs: Any) -> TransformerConfig:
    """A TransformerConfig with fusions off (but the ``kernels`` chosen for the run, where they
    apply: ``toolkit.models.kernels``) and CPU initialisation (full weight, then split).

    CPU initialisation makes the weights of a tp=N model equal to the tp=1 model built with the
    same seed. Batched pipeline p2p is turned off on gloo: gloo matches messages between two
    ranks by order only, and with pp=2 the batched forward/backward sends to the same peer arrive
    swapped in the interleaved schedule (silently wrong activations, same shapes).
    """
    values = {**_UNFUSED, "use_cpu_initialization": True,
              "batch_p2p_comm": runtime.backend() == "nccl", **kwargs}
    if kernels is not None:
        values.update(kernels.config_flags(values))
    if values.get("multi_latent_attention"):  # MLA's sizes and RoPE live in the subclass
        return MLATransformerConfig(**values)
    if "yarn_rotary_scaling_factor" in values:  # GPTModel's YaRN reads these fields
        return YarnTransformerConfig(**values)
    return TransformerConfig(**values)


def layer_spec(
    *,
    num_experts: int | None = None,
    qk_layernorm: bool = False,
    normalization: str = "RMSNorm",
    moe_grouped_gemm: bool = False,
    attention: str | None = None,
    zero_centered_norm: bool = False,
    post_norms: bool = False,
    local_rotary_base: float | None = None,
    multi_latent_attention: bool = False,
    llama4_attention: dict[str, Any] | None = None,
) -> ModuleSpec:
    """megatron-core's local layer spec with TorchNorm in every norm slot (SP-safe) and the core
    attention ``attention`` picks (``toolkit.models.attention``: SDPA on CUDA by default).

    Gemma 3's pieces (``toolkit.models.gemma``): ``zero_centered_norm`` puts the (1 + w) RMSNorm
    in every norm slot (the block's final norm follows the layer's), ``post_norms`` a norm after
    the attention output and the MLP output projections, ``local_rotary_base`` a RoPE base of
    its own for the sliding-window layers.

    ``multi_latent_attention``: megatron-core's ``MLASelfAttention`` (DeepSeek) with its q / kv
    latent norms; its local spec declares no ``sharded_state_dict_keys_map``, it gets the GQA
    spec's, so torch_dist keys are named alike for every family.
    """
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm or multi_latent_attention,
        normalization=normalization,
        multi_latent_attention=multi_latent_attention,
    )
    sub = spec.submodules
    norm = gemma.ZeroCenteredRMSNorm if zero_centered_norm else TorchNorm
    sub.input_layernorm = norm
    sub.pre_mlp_layernorm = norm
    attn = sub.self_attention.submodules
    attn.core_attention = core_attention(attention, latent=multi_latent_attention)
    if llama4_attention is not None:
        attn.core_attention = ModuleSpec(module=llama4.llama4_attention(attn.core_attention),
                                         params=dict(llama4_attention))
    for slot in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if getattr(attn, slot, IdentityOp) is not IdentityOp:
            setattr(attn, slot, norm)
    if multi_latent_attention:
        _mla_without_te()
        sub.self_attention = dataclasses.replace(sub.self_attention, module=mla.MlaSelfAttention)
        sub.sharded_state_dict_keys_map = dict(get_gpt_layer_local_spec(
            normalization=normalization).submodules.sharded_state_dict_keys_map)
    experts = getattr(sub.mlp.submodules, "experts", None)
    if num_experts and hasattr(getattr(experts, "submodules", None), "linear_fc2"):
        # SequentialMLP: fc2 below; the spec objects are replaced, never edited in place
        sub.mlp.submodules.experts = dataclasses.replace(experts, submodules=dataclasses.replace(
            experts.submodules, linear_fc2=ExpertRowParallelLinear))
    if post_norms:
        if num_experts:
            raise ValueError("post_norms: not supported with experts.")
        attn.linear_proj = gemma.RowParallelLinearNorm
        sub.mlp.submodules.linear_fc2 = gemma.RowParallelLinearNorm
    if local_rotary_base is not None:
        sub.self_attention = dataclasses.replace(
            sub.self_attention, module=gemma.LocalRopeSelfAttention,
            params={**sub.self_attention.params, "local_rotary_base": local_rotary_base})
    return spec


class ExpertRowParallelLinear(RowParallelLinear):
    """An expert's output projection. megatron-core 0.16.1's expert MLP adds a biased expert's
    bias in place (``output += bias * per_token_scale``) to this layer's output, which at
    etp=1 is the reduce Function's input returned as-is: a view autograd forbids modifying in
    place, so training GPT-OSS's experts (biases) fails while a forward pass works. With a bias
    to add, the output is returned as a tensor of its own (one copy of an expert's output);
    experts without biases are unchanged."""

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None and torch.is_grad_enabled():
            output = output.clone()
        return output, bias


def _mla_without_te() -> None:
    """Without Transformer Engine, megatron-core 0.16.1's ``multi_latent_attention`` still sees
    TE's placeholders (MagicMock) imported and sets ``HAVE_TE``; its ``isinstance(linear_proj,
    TELinear)`` then fails. Tell it what megatron-core's TE extension knows: TE is absent."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer import multi_latent_attention as mla

    if not te_ext.HAVE_TE:
        mla.HAVE_TE = False


def moe_layer_pattern(config: TransformerConfig) -> list[int] | None:
    """megatron-core's ``moe_layer_freq`` per global layer (1 = MoE, 0 = dense MLP); None when
    every layer is the same (a dense model, or MoE in every layer)."""
    if not config.num_moe_experts:
        return None
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        pattern = [int(i % freq == 0) for i in range(config.num_layers)]
    else:
        pattern = [int(x) for x in freq]
    if len(pattern) != config.num_layers:
        raise ValueError(f"moe_layer_freq has {len(pattern)} entries for {config.num_layers} "
                         "layers.")
    return None if all(pattern) else pattern


def dense_variant(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a MoE layer) with megatron-core's local dense MLP in the MLP slot."""
    mlp = get_mlp_module_spec(use_te=False, num_experts=None)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


def linear_attention_pattern(config: TransformerConfig) -> list[int] | None:
    """megatron-core's ``linear_attention_freq`` per global layer (1 = gated DeltaNet), or None
    for a model without linear-attention layers."""
    if config.experimental_attention_variant != "gated_delta_net":
        return None
    freq = config.linear_attention_freq
    pattern = ([int((i + 1) % freq != 0) for i in range(config.num_layers)]
               if isinstance(freq, int) else [int(x) for x in freq])
    if len(pattern) != config.num_layers:
        raise ValueError(f"linear_attention_freq has {len(pattern)} entries for "
                         f"{config.num_layers} layers.")
    return pattern


def delta_net_variant(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` with the gated DeltaNet in the self-attention slot (its norms kept)."""
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=delta_net.spec(TorchNorm)))


def block_spec(config: TransformerConfig, spec: ModuleSpec,
               vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The decoder block of one (virtual) stage, with the layers' norm as the final norm.

    With MoE and a ``moe_layer_freq`` that leaves some layers dense (as megatron-core's own
    ``get_gpt_decoder_block_spec`` reads it), those layers get the dense MLP; with
    ``linear_attention_freq`` (Qwen3-Next), its linear layers get the gated DeltaNet.
    """
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    moe, linear = moe_layer_pattern(config), linear_attention_pattern(config)
    specs = []
    for layer in range(offset, offset + n):
        one = spec if moe is None or moe[layer] else dense_variant(spec)
        specs.append(delta_net_variant(one) if linear is not None and linear[layer] else one)
    return TransformerBlockSubmodules(layer_specs=specs,
                                      layer_norm=spec.submodules.input_layernorm)


def build_chunks(config: TransformerConfig, spec: ModuleSpec, *,
                 embedding_scale: float | None = None, **gpt_kwargs: Any) -> list[GPTModel]:
    """All GPTModel chunks of this rank: one, or vpp of them with interleaved pipelining
    (``embedding_scale``: word embeddings multiplied by it, Gemma's sqrt(hidden))."""
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if config.context_parallel_size > 1:  # megatron-core's local attention asserts cp == 1
        from toolkit.models.cp_attention import with_cp_attention

        spec = with_cp_attention(spec)
    if config.virtual_pipeline_model_parallel_size != (vpp if vpp > 1 else None):
        config = dataclasses.replace(
            config, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None
        )
    chunks = []
    for v in range(vpp):
        vp_stage = v if vpp > 1 else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(config, spec, vp_stage),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
            **gpt_kwargs,
        )
        if embedding_scale is not None:
            gemma.scale_embeddings(chunk, embedding_scale)
        chunks.append(chunk)
    return chunks
