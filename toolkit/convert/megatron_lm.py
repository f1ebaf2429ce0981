"""The model description of a Megatron-LM checkpoint that carries no HF config.

Megatron-LM's own checkpoints (legacy ``mp_rank_XX`` or ``torch_dist``) hold only its run
arguments (``args``); mdtk's hold an ``hf_config/`` folder. When neither that folder nor
``--hf-config`` is there, the HF config is derived from ``args`` (architecture fields mapped to
the family) and the tokenizer is taken from ``args.tokenizer_model`` when that is an HF folder.
The derived folder (config.json + tokenizer files) is written once per distinct content under
the temp directory, so another conversion of the same checkpoint finds the same folder (a
conversion's workers get the model as read, ``Ctx.spec``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from toolkit.adapters.hfconfig import config_text
from toolkit.adapters.registry import family_for
from toolkit.adapters.spec import has_config, write_config
from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.hf import copy_side_files
from toolkit.checkpoint.megatron_layout import HF_CONFIG_DIR


def _arg(args: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(args, n, None)
        if v is not None:
            return v
    return default


def architecture(args: Any) -> str:
    """The HF architecture of Megatron-LM ``args`` (mdtk stores it as ``hf_architecture``)."""
    stored = getattr(args, "hf_architecture", None)
    if stored:
        return stored
    rope = _arg(args, "position_embedding_type", default="learned_absolute") == "rope"
    if not (rope and getattr(args, "swiglu", False)
            and _arg(args, "normalization", default="LayerNorm") == "RMSNorm"
            and not getattr(args, "add_bias_linear", True)):
        raise CheckpointError(
            "cannot tell the HF architecture from this Megatron-LM checkpoint's args "
            f"(position_embedding_type={getattr(args, 'position_embedding_type', None)!r}, "
            f"swiglu={getattr(args, 'swiglu', None)!r}, normalization="
            f"{getattr(args, 'normalization', None)!r}, add_bias_linear="
            f"{getattr(args, 'add_bias_linear', None)!r}); only Llama-like models (RoPE, SwiGLU, "
            "RMSNorm, no linear biases) are inferred: pass --hf-config DIR.")
    if getattr(args, "num_experts", None):
        if getattr(args, "qk_layernorm", False) or getattr(args, "add_qkv_bias", False):
            raise CheckpointError("cannot tell the HF architecture of this Megatron-LM MoE "
                                  "checkpoint from its args: pass --hf-config DIR.")
        return "MixtralForCausalLM"
    if getattr(args, "qk_layernorm", False):
        return "Qwen3ForCausalLM"
    if getattr(args, "add_qkv_bias", False):
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM"


def tokenizer_folder(args: Any, root: Path) -> Path | None:
    """``args.tokenizer_model`` as an HF tokenizer folder: as given, else against the current
    directory's stand-ins (the checkpoint root and the folder that holds it), as Megatron-LM's
    relative paths are relative to where it was started."""
    name = getattr(args, "tokenizer_model", None)
    if not name:
        return None
    p = Path(name)
    for cand in ([p] if p.is_absolute() else [p, root / p, root.parent / p]):
        if (cand / "tokenizer.json").is_file() or (cand / "tokenizer_config.json").is_file():
            return cand
    return None


def tokenizer_facts(folder: Path) -> dict[str, Any]:
    """From an HF tokenizer folder: ``vocab_size`` = ``len(tokenizer)`` (highest id + 1 in
    ``tokenizer.json``, as Megatron-LM's HuggingFaceTokenizer counts it) and the bos / eos / pad
    token ids named in ``tokenizer_config.json`` (None when not set); {} without tokenizer.json."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return {}
    data = json.loads(file.read_text())
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = dict(vocab) if isinstance(vocab, dict) else {}
    ids.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    top = max([*ids.values(), len(vocab) - 1]) if (ids or vocab) else -1
    out: dict[str, Any] = {"vocab_size": top + 1} if top >= 0 else {}
    conf = folder / "tokenizer_config.json"
    special = json.loads(conf.read_text()) if conf.is_file() else {}
    for kind in ("bos", "eos", "pad"):
        tok = special.get(f"{kind}_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        out[f"{kind}_token_id"] = ids.get(tok) if tok else None
    return out


def hf_config_from_args(args: Any, tokenizer: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of the model Megatron-LM ``args`` describe; ``tokenizer`` (``tokenizer_facts``)
    gives the vocab size when args do not store it, and the special token ids."""
    arch = architecture(args)
    tokenizer = tokenizer or {}
    vocab = getattr(args, "vocab_size", None) or tokenizer.get("vocab_size")
    if not vocab:
        raise CheckpointError(
            "this Megatron-LM checkpoint's args do not store vocab_size and its tokenizer "
            f"(tokenizer_model={getattr(args, 'tokenizer_model', None)!r}) was not found as an HF "
            "tokenizer folder: pass --hf-config DIR, a folder with the model's config.json.")
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    dtype = "bfloat16" if getattr(args, "bf16", False) else (
        "float16" if getattr(args, "fp16", False) else "float32")
    rope: dict[str, Any] = {"rope_theta": float(_arg(args, "rotary_base", default=10000)),
                            "rope_type": "default"}
    if getattr(args, "use_rope_scaling", False):
        rope.update(rope_type="llama3", factor=float(_arg(args, "rope_scaling_factor",
                                                          default=8.0)),
                    low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    if float(_arg(args, "rotary_percent", default=1.0)) != 1.0:
        rope["partial_rotary_factor"] = float(args.rotary_percent)
    cfg: dict[str, Any] = {
        "architectures": [arch], "model_type": family_for(arch).model_types[0],
        "hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers,
        "num_attention_heads": heads, "num_key_value_heads": groups,
        "head_dim": _arg(args, "kv_channels", default=args.hidden_size // heads),
        "intermediate_size": _arg(args, "ffn_hidden_size", default=4 * args.hidden_size),
        "vocab_size": int(vocab), "hidden_act": "silu",
        "max_position_embeddings": _arg(args, "max_position_embeddings", "seq_length"),
        "rms_norm_eps": float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
        "rope_parameters": rope,
        "tie_word_embeddings": not getattr(args, "untie_embeddings_and_output_weights", False),
        "attention_bias": bool(getattr(args, "add_qkv_bias", False)), "mlp_bias": False,
        "attention_dropout": float(_arg(args, "attention_dropout", default=0.0)),
        "dtype": dtype, "initializer_range": float(
            _arg(args, "init_method_std", default=0.02)),
    }
    cfg.update({k: v for k, v in tokenizer.items() if k.endswith("_token_id")})
    if arch == "MixtralForCausalLM":
        cfg.update(num_local_experts=args.num_experts,
                   num_experts_per_tok=_arg(args, "moe_router_topk", default=2),
                   intermediate_size=_arg(args, "moe_ffn_hidden_size", "ffn_hidden_size"),
                   router_aux_loss_coef=float(_arg(args, "moe_aux_loss_coeff", default=0.0)))
    return cfg


def derived_hf_folder(common: dict[str, Any]) -> Path:
    """A folder with the config.json derived from Megatron-LM's ``args`` in ``common`` and the
    tokenizer files of ``args.tokenizer_model`` (when found), shared by every process that asks
    for the same; a CheckpointError naming every place looked at when there are no args."""
    args = common.get("args")
    root = Path(common.get("root") or ".")
    if args is None:
        looked = common.get("looked_for")
        where = (f"config.json in {', '.join(looked)}" if looked else
                 f"{HF_CONFIG_DIR}/config.json in {root} and its two parents")
        raise CheckpointError(f"cannot find the HF config of the checkpoint at {root}: looked "
                              f"for {where}, and it stores no Megatron-LM args to derive one "
                              "from: pass --hf-config DIR, a folder with the model's "
                              "config.json.")
    tok = tokenizer_folder(args, root)
    config = hf_config_from_args(args, tokenizer_facts(tok) if tok else None)
    text = config_text(config)
    key = hashlib.sha256((text + str(tok and tok.resolve())).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / "mdtk-hf-from-args" / key
    if has_config(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=out.parent))
    if tok is not None:
        copy_side_files(tok, tmp)
    write_config(tmp, config)
    try:
        os.rename(tmp, out)
    except OSError:  # another process published the same folder first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
