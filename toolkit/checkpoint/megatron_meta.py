"""What Megatron-LM's checkpoints hold beside the weights, for both of its formats.

``common.pt`` (torch_dist) and every rank file (legacy) carry ``args`` (the run's
``argparse.Namespace``, from which Megatron-LM's loaders rebuild the model), ``iteration`` and
``checkpoint_version``; each linear module of a layer carries an ``_extra_state`` entry
(``[None]`` or None for megatron-core's local layers).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from toolkit.checkpoint.source import ModelAdapter
from toolkit.checkpoint.torchfree import dtypes
from toolkit.lazy import torch

CHECKPOINT_VERSION = 3.0
_LINEAR = re.compile(r"(^|\.)(linear_qkv|linear_proj|linear_fc1|linear_fc2|linear_q_proj"
                     r"|linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj"
                     r"|linear_kv_up_proj|in_proj|out_proj)\.weight$")  # in/out_proj: DeltaNet

#: Megatron-LM's own defaults (``megatron/training/arguments.py``, core_v0.16.1) for the model
#: arguments its loaders read (``load_args_from_checkpoint``, ``check_checkpoint_args``,
#: ``tools/checkpoint``) that a model may leave unset; the model's values go on top.
MEGATRON_LM_DEFAULTS: dict[str, Any] = {
    "add_position_embedding": True, "use_rotary_position_embeddings": False,
    "rotary_base": 10000, "rotary_percent": 1.0, "rotary_interleaved": False,
    "rotary_seq_len_interpolation_factor": None, "use_rope_scaling": False,
    "rope_scaling_factor": 8.0, "squared_relu": False, "apply_layernorm_1p": False,
    "apply_query_key_layer_scaling": False, "qk_layernorm": False, "attention_dropout": 0.1,
    "hidden_dropout": 0.1, "window_size": None, "window_attn_skip_freq": None,
    "num_experts": None, "moe_layer_freq": 1, "moe_ffn_hidden_size": None, "moe_router_topk": 2,
    "moe_token_dispatcher_type": "allgather", "moe_router_pre_softmax": False,
    "moe_grouped_gemm": False, "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False, "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False, "moe_router_topk_scaling_factor": None,
    "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0,
    "moe_input_jitter_eps": None, "spec": None, "hybrid_override_pattern": None,
    "hybrid_attention_ratio": 0.0, "hybrid_mlp_ratio": 0.0, "is_hybrid_model": False,
    "tokenizer_type": "HuggingFaceTokenizer", "consumed_train_samples": 0,
    "consumed_valid_samples": 0, "finetune": False,
}

#: ``transformer_kwargs`` / ``model_kwargs`` names whose Megatron-LM argument is named otherwise.
_ARG_NAMES = {"num_moe_experts": "num_experts", "gated_linear_unit": "swiglu",
              "max_sequence_length": "max_position_embeddings",
              "rope_scaling": "use_rope_scaling",
              "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor"}


def megatron_args(adapter: ModelAdapter, layout: Any, padded_vocab: int, iteration: int | None,
                  ckpt_format: str, dtype: torch.dtype, tokenizer_model: str | None = None
                  ) -> argparse.Namespace:
    """The run arguments Megatron-LM writes for this model, so that its ``--load`` (with or
    without ``--use-checkpoint-args``) and ``tools/checkpoint`` loaders build the same model.

    The vocab is padded to a multiple of ``make_vocab_size_divisible_by x tp`` (Megatron-LM
    stores the multiple without tp); no rng or optimizer state is written, which
    ``no_save_rng`` / ``no_save_optim`` declare so that a plain ``--load`` skips them.
    """
    d = adapter.dims
    hf = adapter.hf_config
    out = dict(MEGATRON_LM_DEFAULTS)
    for k, v in {**adapter.family.transformer_kwargs(hf),
                 **adapter.family.model_kwargs(hf)}.items():
        out[_ARG_NAMES.get(k, k)] = v
    if isinstance(out["rotary_base"], float) and out["rotary_base"].is_integer():
        out["rotary_base"] = int(out["rotary_base"])  # Megatron-LM's --rotary-base is an int
    if isinstance(out.get("window_size"), tuple):
        out["window_size"] = list(out["window_size"])
    multiple = getattr(adapter, "vocab_multiple", 1)
    seq = out["max_position_embeddings"]
    out.update(
        num_layers=d.layers, hidden_size=d.hidden, num_attention_heads=d.heads,
        num_query_groups=d.groups, kv_channels=d.head_dim,
        group_query_attention=d.groups != d.heads,
        seq_length=seq, encoder_seq_length=seq, swiglu=bool(out.get("swiglu")),
        vocab_size=d.vocab, padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=multiple if padded_vocab % (multiple * layout.tp) == 0
        else 1, untie_embeddings_and_output_weights=not d.tied, tokenizer_model=tokenizer_model,
        num_experts=d.experts or None, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if (layout.vpp or 1) > 1 else None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp,
        ckpt_format=ckpt_format, use_dist_ckpt=ckpt_format == "torch_dist",
        iteration=iteration or 0, no_save_rng=True, no_save_optim=True,
        params_dtype=dtype, bf16=dtypes.name_of(dtype) == "bfloat16",
        fp16=dtypes.name_of(dtype) == "float16",
        hf_architecture=adapter.architecture,
    )
    return argparse.Namespace(**out)


#: What Megatron-LM's ``save_checkpoint`` puts next to ``args`` (core_v0.16.1): the content
#: metadata torch_dist checkpoints carry (``common.pt``) for its optimizer sharding.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def layout_of(args: Any) -> dict[str, Any]:
    """tp / pp / vpp / ep of Megatron-LM run arguments (``common.pt``'s ``args``)."""
    keys = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
            "vpp": "virtual_pipeline_model_parallel_size", "ep": "expert_model_parallel_size"}
    return {k: getattr(args, v, None) for k, v in keys.items()} if args is not None else {}


def extra_state_module(name: str) -> str | None:
    """The module of a linear layer's weight (which carries ``_extra_state``), else None."""
    return name[: -len(".weight")] if _LINEAR.search(name) else None
