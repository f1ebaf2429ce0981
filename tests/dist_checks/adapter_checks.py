"""Tiny HF checkpoints of every dense family, and rank functions checking the adapters on them.

Checkpoints are built from the real transformers config classes with random weights (norm
weights and biases too, so a mis-mapped one shows), saved with ``save_pretrained``; the
reference logits come from the real HF model (fp32, eager attention) reloaded from disk.
Rank functions loop over families and layouts inside one pool call and return numbers.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH = 1001, 12, 2

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

GEMMA3_LAYERS = ["sliding_attention", "full_attention"] * 2
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


def tiny_configs() -> dict:
    """One small config per dense family; GQA, odd vocab, biases and tying as each family has."""
    import transformers as tf

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    return {
        # Llama 3.2 style: tied embeddings, llama3 rope scaling.
        "llama": tf.LlamaConfig(**common, tie_word_embeddings=True,
                                max_position_embeddings=16384, rope_parameters=LLAMA3_ROPE),
        # Llama 2 style with all biases on (attention_bias and mlp_bias), MHA, untied.
        "llama_bias": tf.LlamaConfig(**{**common, "num_key_value_heads": 4},
                                     attention_bias=True, mlp_bias=True),
        "mistral": tf.MistralConfig(**common, sliding_window=5, head_dim=16),
        "qwen2": tf.Qwen2Config(**common),
        "qwen3": tf.Qwen3Config(**common, head_dim=24),
        # Phi-4-mini style: fused qkv_proj / gate_up_proj, tied, partial RoPE (rotary_percent),
        # plus Phi-3-mini's sliding window.
        "phi3": tf.Phi3Config(**common, tie_word_embeddings=True, partial_rotary_factor=0.75,
                              sliding_window=5, pad_token_id=0),
        # Gemma 3: (1 + w) norms, sqrt(hidden) embedding scale, GeGLU, post-norms, q/k norms,
        # query_pre_attn_scalar != head_dim, sliding / global layers with two RoPE bases (the
        # global one linearly scaled), tied.
        "gemma3": tf.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=24,
                                      sliding_window=5, layer_types=GEMMA3_LAYERS,
                                      rope_parameters=GEMMA3_ROPE, pad_token_id=0),
        "gpt2": tf.GPT2Config(n_embd=64, n_layer=4, n_head=4, n_inner=96, vocab_size=VOCAB,
                              n_positions=64, bos_token_id=1, eos_token_id=2),
    }


def tiny_moe_configs() -> dict:
    """Small mixture-of-experts configs (4 experts, top-2, GQA, odd vocab)."""
    import transformers as tf

    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    return {
        "mixtral": tf.MixtralConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=VOCAB, num_local_experts=4,
                                    num_experts_per_tok=2, rms_norm_eps=1e-5, bos_token_id=1,
                                    eos_token_id=2, sliding_window=None),
        # Routed experts + a gated shared expert, q/k/v biases, softmax-then-top-k routing
        # without renormalisation (norm_topk_prob=False, as the released Qwen2-MoE configs).
        "qwen2_moe": tf.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                                       shared_expert_intermediate_size=80,
                                       norm_topk_prob=False),
        # q/k norm, head_dim 24 != 64 / 4, top-k then renormalise (norm_topk_prob=True); layer 2
        # has a dense MLP (mlp_only_layers -> megatron-core's moe_layer_freq).
        "qwen3_moe": tf.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                                       head_dim=24, norm_topk_prob=True, mlp_only_layers=[2]),
        "deepseek_v3": tiny_deepseek_v3(),
        "qwen3_next": tiny_qwen3_next(),
        "llama4": tiny_llama4(),
    }


#: GPT-OSS's published YaRN (truncate false), scaled to the tiny context.
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
#: Kimi K2's published YaRN (beta_fast = beta_slow = 1), scaled to the tiny context.
KIMI_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "mscale": 1.0,
             "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 64}


def tiny_open_moe_configs(**overrides) -> dict:
    """Today's open MoE families (issue 39), checked at their own layouts (test_adapters.py):
    GPT-OSS (sinks, sliding / full layers with a window of 5 < SEQ, YaRN, experts with biases
    and a clamped SwiGLU whose limit 0.5 the random weights pass), GLM-4.5 (partial RoPE, q/k
    norm, q/k/v biases, sigmoid routing in 2 groups, shared expert, layer 0 dense) and Kimi K2
    (DeepSeek-V3 with one group and its own YaRN; config.json says ``kimi_k2``)."""
    import transformers as tf

    common = {**dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-5,
                     bos_token_id=1, eos_token_id=2, max_position_embeddings=256), **overrides}
    return {
        "gpt_oss": tf.GptOssConfig(**common, head_dim=16, intermediate_size=64,
                                   num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                                   swiglu_limit=0.5, rope_parameters=GPT_OSS_YARN),
        "glm4_moe": tf.Glm4MoeConfig(**common, intermediate_size=96, moe_intermediate_size=40,
                                     n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                     topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                     routed_scaling_factor=2.5, attention_bias=True,
                                     use_qk_norm=True, partial_rotary_factor=0.5),
        "kimi_k2": tiny_deepseek_v3(n_routed_experts=8, n_group=1, topk_group=1,
                                    num_experts_per_tok=3, routed_scaling_factor=2.827,
                                    rope_parameters=KIMI_YARN, **overrides),
    }


def as_kimi_k2(path: Path) -> None:
    """Rewrite a saved DeepSeek-V3 folder's config.json as Kimi K2 publishes it: its own model
    type, read by remote code that is DeepSeek-V3's (transformers has no ``kimi_k2``)."""
    file = path / "config.json"
    config = json.loads(file.read_text())
    config.update(model_type="kimi_k2", auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def tiny_qwen3_next(**overrides):
    """Qwen3-Next in small: both layer kinds (gated DeltaNet layers 0, 1, 3; gated attention
    layer 2), 2 key heads x 2 value heads each (grouped values), head sizes 8 / 12, kernel 4,
    partial RoPE 0.25 of head_dim 16, a gated shared expert, layer 1 dense (mlp_only_layers)."""
    import transformers as tf

    kw = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
              shared_expert_intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_experts=4,
              num_experts_per_tok=2, mlp_only_layers=[1], linear_conv_kernel_dim=4,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
              linear_num_value_heads=4, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              layer_types=["linear_attention", "linear_attention", "full_attention",
                           "linear_attention"])
    return tf.Qwen3NextConfig(**{**kw, **overrides})


def tiny_llama4(**overrides):
    """Llama 4 text in small: chunks of 5 tokens (SEQ 12: three chunks), NoPE layers 1 and 3
    with temperature tuning active from position 3 (floor_scale 4), q/k L2 norm on the RoPE
    layers, MoE on layers 1 and 3 (top-1 sigmoid, shared expert), dense MLP of 96 elsewhere."""
    import transformers as tf

    kw = dict(hidden_size=64, intermediate_size=48, intermediate_size_mlp=96,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=1,
              interleave_moe_layer_step=2, attention_chunk_size=5, floor_scale=4, attn_scale=0.5,
              no_rope_layer_interval=2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    return tf.Llama4TextConfig(**{**kw, **overrides})


#: DeepSeek-V3's published YaRN settings, scaled to the tiny context.
DSV3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
             "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
             "original_max_position_embeddings": 64}


def tiny_deepseek_v3(**overrides):
    """DeepSeek-V3 in small: MLA with q/kv LoRA, YaRN, 4 experts in 2 groups (top-1 group,
    top-2 experts: group score = top-2 sum, as the real 8 / 4 / 8), a shared expert, layer 0
    dense, routed scaling; odd sizes (q_lora 20, kv_lora 14 + rope 6) so a wrong split shows."""
    import transformers as tf

    kw = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=40,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=VOCAB, n_routed_experts=4, n_group=2, topk_group=1,
              num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
              routed_scaling_factor=2.5, q_lora_rank=20, kv_lora_rank=14, qk_rope_head_dim=6,
              qk_nope_head_dim=10, v_head_dim=12, max_position_embeddings=256,
              rope_parameters=DSV3_YARN, bos_token_id=1, eos_token_id=2)
    return tf.DeepseekV3Config(**{**kw, **overrides})


def add_mtp_layer(path: Path, config) -> None:
    """Store a random multi-token-prediction layer past ``num_hidden_layers``, named as the
    published DeepSeek-V3 checkpoints name it (``model.layers.61.*`` there): enorm, hnorm,
    eh_proj, shared_head, its own embedding and a full MoE decoder layer. HF skips it; mdtk
    must carry it through exports and conversions bit-exactly."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    last, mtp, h = config.num_hidden_layers - 1, config.num_hidden_layers, config.hidden_size
    g = torch.Generator().manual_seed(61)
    extra = {k.replace(f"layers.{last}.", f"layers.{mtp}."): v
             for k, v in tensors.items() if k.startswith(f"model.layers.{last}.")}
    extra.update({f"model.layers.{mtp}.{k}": torch.empty(s) for k, s in [
        ("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
        ("shared_head.norm.weight", (h,)), ("shared_head.head.weight", (VOCAB, h)),
        ("embed_tokens.weight", (VOCAB, h))]})
    for k, v in extra.items():
        tensors[k] = torch.randn(v.shape, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})


#: Norm weights that scale by (1 + w) (zero-centred): drawn around 0, so that random models
#: keep activations of a trained model's size instead of doubling them at every norm.
ZERO_CENTRED_NORMS = {"qwen3_next": ("input_layernorm.weight", "post_attention_layernorm.weight",
                                     "q_norm.weight", "k_norm.weight", "model.norm.weight")}

#: Weight scale of the hybrid (DeltaNet layers add their output gate's and the MoE's products):
#: keeps its activations O(1), as in a trained model, so fp32 rounding stays below 1e-6 relative.
INIT_STD = {"qwen3_next": 0.1}


def tokens(vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def write_mxfp4(src: Path, dst: Path, scales: tuple[int, int] = (118, 126),
                seed: int = 5) -> Path:
    """``dst``: the GPT-OSS folder ``src`` with its experts replaced by random MXFP4 blocks in
    GPT-OSS's published layout (every nibble; scale bytes in ``scales``: powers of two
    2^(s - 127)) and config.json's ``quantization_config`` as published."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            weights[name] = t
            continue
        experts, inn, out = t.shape
        weights[name + "_blocks"] = torch.randint(0, 256, (experts, out, inn // 32, 16),
                                                  generator=g, dtype=torch.uint8)
        weights[name + "_scales"] = torch.randint(*scales, (experts, out, inn // 32),
                                                  generator=g, dtype=torch.uint8)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def make_mxfp4(root: Path, source: str = "gpt_oss") -> Path:
    """``root/<source>_mxfp4``: the tiny GPT-OSS with its experts in GPT-OSS's published MXFP4
    layout (random FP4 nibbles, scales 2^-9..2^-2; everything else as ``source``), and
    ``<source>_mxfp4.logits.pt``: the logits of transformers' own loading of it (its ``Mxfp4Config``
    dequantizes on CPU), the reference mdtk's dequantize-on-read must give."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    dst = write_mxfp4(root / source, root / f"{source}_mxfp4")
    ref = AutoModelForCausalLM.from_pretrained(
        dst, dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True))
    with torch.no_grad():
        torch.save(ref(tokens()).logits, root / f"{dst.name}.logits.pt")
        experts = ref.model.layers[0].mlp.experts
        torch.save({"gate_up_proj": experts.gate_up_proj.clone(),
                    "down_proj": experts.down_proj.clone()}, root / f"{dst.name}.layer0.pt")
    return dst


#: A tiny GPT-OSS quantized by transformers' own MXFP4 quantizer, and the weights its quantized
#: model holds (scripts/make_mxfp4_fixture.py says how it was made).
TRANSFORMERS_MXFP4 = Path(__file__).resolve().parents[1] / "data" / "gpt_oss_mxfp4_transformers"
#: A GPT-OSS saved by transformers 5.23 after loading it dequantized (scripts/
#: make_dequantized_save_fixture.py): bf16 experts under the ``*_blocks`` names.
TRANSFORMERS_DEQUANTIZED_SAVE = TRANSFORMERS_MXFP4.parent / "gpt_oss_dequantized_save"


def copy_transformers_mxfp4(root: Path) -> Path:
    """``root/gpt_oss_mxfp4_tf``: the fixture's quantized folder (blocks along the output
    dimension, as transformers saves them), and ``gpt_oss_mxfp4_tf.logits.pt``: the logits of
    transformers on the model its quantizer made (the quantized folder's other tensors with the
    experts OpenAI's dequantizer unpacked from the quantized model), with ``.layer0.pt``."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    dst, dense = root / "gpt_oss_mxfp4_tf", root / "gpt_oss_mxfp4_tf_dense"
    shutil.copytree(TRANSFORMERS_MXFP4 / "quantized", dst)
    config = json.loads((dst / "config.json").read_text())
    config["dtype"] = "float32"  # computed in fp32, as the other families (weights: bf16)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    experts = load_file(str(TRANSFORMERS_MXFP4 / "dequantized_experts.safetensors"))
    weights = {n: t for n, t in load_file(str(dst / "model.safetensors")).items()
               if not n.endswith(("_blocks", "_scales"))}
    dense.mkdir()
    save_file({**weights, **experts}, str(dense / "model.safetensors"), metadata={"format": "pt"})
    del config["quantization_config"]
    (dense / "config.json").write_text(json.dumps(config, indent=2))
    ref = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32,
                                               attn_implementation="eager")
    with torch.no_grad():
        torch.save(ref(tokens(config["vocab_size"])).logits, root / f"{dst.name}.logits.pt")
    torch.save({p: experts[f"model.layers.0.mlp.experts.{p}"] for p in ("gate_up_proj",
                                                                        "down_proj")},
               root / f"{dst.name}.layer0.pt")
    return dst


def build_checkpoints(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Save each tiny model to ``root/<name>`` and its HF logits to ``root/<name>.logits.pt``."""
    from transformers import AutoModelForCausalLM

    from toolkit.runtime import cpu_compat

    if cpu_compat.PATCHED:
        raise RuntimeError("the HF references must be built in a process without mdtk's CPU "
                           "mode: transformers loads models with garbage RoPE buffers after it.")
    out = {}
    configs = {**tiny_configs(), **tiny_moe_configs(), **tiny_open_moe_configs()}
    for i, (name, config) in enumerate(configs.items()):
        if names and name not in names:
            continue
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if name in ZERO_CENTRED_NORMS and pname.endswith(ZERO_CENTRED_NORMS[name]):
                    p.copy_(0.2 * torch.randn_like(p))  # gain 1 + w: near 1, as trained
                elif "norm" in pname or ".ln_" in pname:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                else:
                    p.normal_(0.0, INIT_STD.get(name, 0.15))
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):  # a weight HF keeps as a buffer
                    b.copy_(0.3 * torch.randn_like(b))
        path = root / name
        model.save_pretrained(path)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                   attn_implementation="eager")
        with torch.no_grad():
            logits = ref(tokens()).logits
        torch.save(logits, root / f"{name}.logits.pt")
        if name in ("deepseek_v3", "glm4_moe"):
            add_mtp_layer(path, config)
        if name == "kimi_k2":
            as_kimi_k2(path)
        if name == "gpt_oss":
            make_mxfp4(root)
            copy_transformers_mxfp4(root)
        out[name] = path
    return out


# -- rank functions -------------------------------------------------------------------------------

def _layout_kwargs(layout: dict):
    from toolkit.parallel import ParallelLayout

    return ParallelLayout(**layout)


def compare_tensors(a: Path, b: Path) -> dict:
    """Names equal and every tensor torch.equal (same dtype and shape) between two HF folders."""
    from toolkit.checkpoint.hf import HFReader

    with HFReader(a) as ra, HFReader(b) as rb:
        names_a, names_b = set(ra.names), set(rb.names)
        unequal = []
        for name in sorted(names_a & names_b):
            ta = ra.read(name, tuple((0, n) for n in ra.shape(name)))
            tb = rb.read(name, tuple((0, n) for n in rb.shape(name)))
            if ta.dtype != tb.dtype or ta.shape != tb.shape or not torch.equal(ta, tb):
                unequal.append(name)
    return {"only_a": sorted(names_a - names_b), "only_b": sorted(names_b - names_a),
            "unequal": unequal, "n": len(names_a)}


def check_layouts(root: str, families: list[str], layouts: list[dict],
                  skip: tuple[tuple[str, dict], ...] = ()) -> list[dict]:
    """For each family x layout but the ``skip`` pairs: logits vs HF, export round trip, and
    what was read from disk."""
    from toolkit import parallel
    from toolkit.adapters import adapter_for
    from toolkit.adapters.live import (
        build_model,
        current_coord,
        export_hf,
        fill_chunks,
        forward_logits,
        open_weights,
    )

    rootp = Path(root)
    results = []
    for family in families:
        ref = torch.load(rootp / f"{family}.logits.pt", weights_only=True)
        ids = tokens(ref.shape[-1])
        for spec in layouts:
            if (family, spec) in skip:
                continue
            start = time.perf_counter()
            layout = _layout_kwargs(spec)
            mpu = parallel.initialize(layout)
            adapter = adapter_for(rootp / family)
            with open_weights(adapter, rootp / family) as reader:
                chunks = build_model(adapter, mpu.layout)
                fill_chunks(chunks, adapter, reader)
                reads = [(r.name, r.shape, r.nbytes) for r in reader.reads]
                stacked = {e for r in reader.reads if re.search(r"experts\.\w+_proj$", r.name)
                           for e in range(*r.region[0])}  # experts sliced from 3-D tensors
                full = {n: reader.shape(n) for n in reader.names}
            logits = forward_logits(chunks, ids, adapter.dims.vocab)
            tag = "-".join(f"{k}{v}" for k, v in spec.items()) or "single"
            out_dir = rootp / "export" / f"{family}-{tag}"
            export_hf(chunks, adapter, out_dir, overwrite=True)
            row = {"family": family, "layout": spec, "rank": dist.get_rank(),
                   "coord": current_coord(),
                   "max_abs": (logits - ref).abs().max().item(),
                   "max_rel": ((logits - ref).abs().max() / ref.abs().max()).item(),
                   "reads": reads, "full_shapes": full, "stacked_experts": stacked}
            if dist.get_rank() == 0:
                row["roundtrip"] = compare_tensors(rootp / family, out_dir)
                row["files"] = sorted(p.name for p in out_dir.iterdir())
                row["config_equal"] = _config_equal(rootp / family, out_dir)
            row["seconds"] = time.perf_counter() - start
            results.append(row)
            parallel.destroy()
    return results


def _config_equal(a: Path, b: Path) -> bool:
    ca = json.loads((a / "config.json").read_text())
    cb = json.loads((b / "config.json").read_text())
    return ca == cb


def wrong_mapping_diff(root: str) -> float:
    """Logit diff when gate and up are swapped in the Llama mapping (must be large): shows the
    logits comparison can fail."""
    from model_adapters.llama import Llama
    from toolkit import parallel
    from toolkit.adapters import Adapter, load_hf_config
    from toolkit.adapters.live import build_model, fill_chunks, forward_logits
    from toolkit.checkpoint.hf import HFReader
    from toolkit.mapping import GateUp

    class Swapped(Llama):
        def mlp_rules(self, d, i, p):
            rules = super().mlp_rules(d, i, p)
            r = rules["mlp.linear_fc1.weight"]
            rules["mlp.linear_fc1.weight"] = GateUp(r.up, r.gate, r.ffn, r.inn)
            return rules

    path = Path(root) / "llama"
    mpu = parallel.initialize(_layout_kwargs({"tp": 2}))
    adapter = Adapter(Swapped(), load_hf_config(path), source=path)
    with HFReader(path) as reader:
        chunks = build_model(adapter, mpu.layout)
        fill_chunks(chunks, adapter, reader)
    logits = forward_logits(chunks, tokens(), adapter.dims.vocab)
    parallel.destroy()
    ref = torch.load(Path(root) / "llama.logits.pt", weights_only=True)
    return (logits - ref).abs().max().item()


def wrong_routing_diff(root: str, families: list[str]) -> dict[str, float]:
    """Logit diff of each MoE family loaded with the other routing normalisation
    (``moe_router_pre_softmax`` flipped; must be large): shows norm_topk_prob is tested."""
    from toolkit import parallel
    from toolkit.adapters import adapter_for
    from toolkit.adapters.live import build_model, fill_chunks, forward_logits
    from toolkit.checkpoint.hf import HFReader

    out = {}
    for family in families:
        path = Path(root) / family
        mpu = parallel.initialize(_layout_kwargs({}))
        adapter = adapter_for(path)
        flipped = not adapter.transformer_config(mpu.layout).moe_router_pre_softmax
        with HFReader(path) as reader:
            chunks = build_model(adapter, mpu.layout, moe_router_pre_softmax=flipped)
            fill_chunks(chunks, adapter, reader)
        logits = forward_logits(chunks, tokens(), adapter.dims.vocab)
        parallel.destroy()
        ref = torch.load(Path(root) / f"{family}.logits.pt", weights_only=True)
        out[family] = (logits - ref).abs().max().item()
    return out


def check_dtypes(root: str, out: str) -> dict:
    """Load an fp32 checkpoint as bf16 at tp=2 through ``load_hf``; export keeps the checkpoint's
    dtype by default (values = bf16-rounded originals) or writes the dtype asked for."""
    from toolkit import parallel
    from toolkit.adapters.live import export_hf, load_hf
    from toolkit.checkpoint import CheckpointError
    from toolkit.checkpoint.hf import HFReader

    src = Path(root) / "qwen2"
    chunks, adapter = load_hf(src, _layout_kwargs({"tp": 2}), dtype="bfloat16")
    param_dtypes = sorted({str(p.dtype) for c in chunks for p in c.parameters()})
    a, b = Path(out) / "as-source", Path(out) / "as-bf16"
    export_hf(chunks, adapter, a)
    export_hf(chunks, adapter, b, dtype=torch.bfloat16)
    try:  # an existing folder is refused on every rank (no rank left waiting in a send)
        export_hf(chunks, adapter, a)
        exists_error = None
    except CheckpointError as err:
        exists_error = str(err)
    parallel.destroy()
    result = {"param_dtypes": param_dtypes, "exists_error": exists_error}
    if dist.get_rank() == 0:
        mismatched = []
        with HFReader(src) as rs, HFReader(a) as ra, HFReader(b) as rb:
            for name in rs.names:
                full = tuple((0, n) for n in rs.shape(name))
                want = rs.read(name, full).to(torch.bfloat16)
                got_a, got_b = ra.read(name, full), rb.read(name, full)
                if got_a.dtype != torch.float32 or not torch.equal(got_a, want.float()):
                    mismatched.append(("as-source", name))
                if got_b.dtype != torch.bfloat16 or not torch.equal(got_b, want):
                    mismatched.append(("as-bf16", name))
        result.update(mismatched=mismatched, n=len(rs.names),
                      config_dtypes=[json.loads((p / "config.json").read_text())["dtype"]
                                     for p in (a, b)])
    return result


def verify_hf_mcore(path: str, reference) -> dict:
    """toolkit.convert.verify's megatron-core runner vs an HF run made in the test process."""
    from toolkit.convert.verify import compare, run_hf_mcore

    c = compare(reference, run_hf_mcore(Path(path), reference_tokens()))
    return {"max_abs": c.max_abs, "max_rel": c.max_rel, "layers": c.layers}


def reference_tokens() -> torch.Tensor:
    from toolkit.convert.verify import fixed_tokens

    return fixed_tokens(VOCAB, 2, 16)


def check_cuda_logits(root: str, families: list[str], cp: int = 1) -> dict[str, float]:
    """Each family loaded through the adapter on this rank's GPU (the GPU defaults: SDPA core
    attention; mdtk's CP attention at ``cp`` > 1) vs transformers' CPU fp32 logits saved by
    ``build_checkpoints``: max abs diff."""
    from toolkit import parallel
    from toolkit.adapters import adapter_for
    from toolkit.adapters.live import build_model, fill_chunks, forward_logits, open_weights
    from toolkit.parallel import ParallelLayout

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rootp = Path(root)
    out = {}
    for family in families:
        ref = torch.load(rootp / f"{family}.logits.pt", weights_only=True)
        mpu = parallel.initialize(ParallelLayout(cp=cp))
        adapter = adapter_for(rootp / family, dtype=torch.float32)
        with open_weights(adapter, rootp / family) as reader:  # GPT-OSS: its fused experts
            chunks = build_model(adapter, mpu.layout)
            fill_chunks(chunks, adapter, reader)
        chunks = [c.cuda() for c in chunks]
        mixers = [layer.self_attention for layer in chunks[0].decoder.layers]
        core = next(type(m.core_attention).__name__ for m in mixers if hasattr(m, "core_attention"))
        with torch.no_grad():
            logits = forward_logits(chunks, tokens(), adapter.dims.vocab)
        out[family] = {"max_abs": (logits - ref).abs().max().item(), "core": core}
        if adapter.dims.delta_layers:  # Qwen3-Next: which kernels computed its DeltaNet layers
            from toolkit.models.delta_net import kernel_names

            out[family]["delta"] = kernel_names(next(chunks[0].parameters()).device)
        parallel.destroy()
    return out
