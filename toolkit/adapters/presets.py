"""Built-in model presets: the published ``config.json`` values of well-known checkpoints.

They let ``mdtk estimate`` / ``mdtk ds-config`` size real models without a hub download. Only the
keys the families read for the model's shape are kept (plus numerics); every value is the one in
the model's public config.json.
"""

from __future__ import annotations

import copy
from typing import Any

_LLAMA3 = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
    vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False,
    mlp_bias=False, max_position_embeddings=131072,
)

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=768, n_layer=12, n_head=12,
        n_positions=1024, vocab_size=50257, n_inner=None, activation_function="gelu_new",
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        _LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        _LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "llama-3.1-70b": dict(
        _LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu",
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_act="silu",
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_act="silu",
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # deepseek-ai/DeepSeek-V3 config.json (also R1 / V3-0324 / V3.1: same shapes). 671B = the
    # 61 layers' weights incl. e_score_correction_bias; the MTP layer (layer 61) is not counted.
    "deepseek-v3": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_act="silu",
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
        norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000, rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40,
                                        "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "original_max_position_embeddings": 4096, "type": "yarn"},
        vocab_size=129280, tie_word_embeddings=False, num_nextn_predict_layers=1,
    ),
}


def get_preset(name: str) -> dict[str, Any]:
    """A copy of the preset's config dict; KeyError names the known presets."""
    key = name.lower()
    if key not in MODEL_PRESETS:
        known = ", ".join(sorted(MODEL_PRESETS))
        raise KeyError(f"unknown model preset {name!r}; known presets: {known}")
    return copy.deepcopy(MODEL_PRESETS[key])
