"""Rank functions: real DeepSpeed engines on CPU/gloo, measured against the memory model.

A tiny HF Llama (random weights) is trained with a given DeepSpeed config. After one full step,
the next step's forward/backward runs and, before its ``step()``, every tensor the rank holds is
counted: module parameters (and stage-3 partitions, hpZ's secondary partitions), gradients, and
every tensor reachable from the engine's optimizer object (flat 16-bit groups, fp32 partitions,
Adam state, buckets).
Storage is counted once however many views point at it.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

TINY_LLAMA = dict(
    model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=64,
    tie_word_embeddings=False, rms_norm_eps=1e-5,
)
SEQ, SEED = 16, 1234


def tiny_llama(**overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**TINY_LLAMA, **overrides}
    cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(cfg)


def zero_options(ds_config: dict):
    """The memory model's ZeroOptions of a run's DeepSpeed config (its stage and buckets; the
    model's defaults where the config leaves a key out)."""
    from toolkit.memory import ZeroOptions

    z, d = ds_config["zero_optimization"], ZeroOptions()
    return ZeroOptions(
        stage=z["stage"], reduce_bucket_size=z.get("reduce_bucket_size", d.reduce_bucket_size),
        allgather_bucket_size=z.get("allgather_bucket_size", d.allgather_bucket_size),
        prefetch_bucket_size=z.get("stage3_prefetch_bucket_size", d.prefetch_bucket_size),
        param_persistence_threshold=z.get("stage3_param_persistence_threshold",
                                          d.param_persistence_threshold))


def _add(out: dict[int, int], t: torch.Tensor) -> None:
    if t.device.type == "meta":
        return
    st = t.untyped_storage()
    if st.nbytes():
        out[st.data_ptr()] = max(out.get(st.data_ptr(), 0), st.nbytes())


def _walk(obj: Any, seen: set[int], out: dict[int, int], depth: int) -> None:
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        _add(out, obj)
        for extra in (obj.grad, getattr(obj, "ds_tensor", None),
                      getattr(obj, "ds_secondary_tensor", None)):  # ZeRO++ hpZ's copy
            if isinstance(extra, torch.Tensor):
                _walk(extra, seen, out, depth + 1)
        return
    if isinstance(obj, nn.Module):
        return  # module tensors are counted from engine.module.parameters()
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(k, seen, out, depth + 1)
            _walk(v, seen, out, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _walk(v, seen, out, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("deepspeed", "torch.optim")):
        for v in vars(obj).values():
            _walk(v, seen, out, depth + 1)


def held_bytes(engine) -> int:
    """Bytes of every distinct storage this rank holds for parameters, grads and the optimizer."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    for p in engine.module.parameters():
        _walk(p, seen, out, 0)
    _walk(engine.optimizer, seen, out, 0)
    return sum(out.values())


def _batch(vocab: int, micro: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (micro, SEQ), generator=g)
    return tokens, tokens.clone()


def train_and_measure(config: dict[str, Any], steps: int = 3, nvme_dir: str | None = None,
                      save_dir: str | None = None, **model_overrides: Any) -> dict[str, Any]:
    """Train ``steps`` steps on a fixed batch; return losses and the bytes held before the
    last step's optimizer update (gradients and optimizer states both alive). ``save_dir``:
    then also ``save_checkpoint`` there (with the model's config.json beside, as HF Trainer's
    ``checkpoint-N/`` has it) and the engine's own 16-bit export in ``save_dir/export``."""
    import deepspeed
    import torch.distributed as dist

    from toolkit import runtime

    runtime.prepare_deepspeed()
    config = copy.deepcopy(config)
    if nvme_dir is not None:  # one swap folder per rank and per engine (they delete each other's)
        path = os.path.join(nvme_dir, f"rank{dist.get_rank()}")
        os.makedirs(path, exist_ok=True)
        for key in ("offload_optimizer", "offload_param"):
            block = config.get("zero_optimization", {}).get(key)
            if block and block.get("device") == "nvme":
                block["nvme_path"] = path
    model = tiny_llama(**model_overrides)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=model.parameters())
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    vocab = model.config.vocab_size
    tokens, labels = _batch(vocab, micro, seed=dist.get_rank())
    losses, measured = [], 0
    for step in range(steps):
        for _ in range(gas):
            loss = engine(input_ids=tokens, labels=labels).loss
            engine.backward(loss)
            if step == steps - 1:
                measured = held_bytes(engine)
            engine.step()
        losses.append(float(loss.detach()))
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
        engine.save_16bit_model(os.path.join(save_dir, "export"))
        if dist.get_rank() == 0:
            model.config.architectures = [type(model).__name__]
            model.config.save_pretrained(save_dir)
    engine.destroy()
    del engine
    return {"losses": losses, "held_bytes": measured}


# -- activations of a megatron-core GPTModel, counted with saved-tensor hooks ------------------

# Llama-like: RMSNorm, SwiGLU, RoPE, grouped-query attention (4 heads, 2 groups), no biases.
ACT_MODEL = dict(hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32, micro=2)


def saved_bytes_of_forward(model, tokens: torch.Tensor, pos: torch.Tensor | None = None) -> int:
    """Bytes of the distinct storages autograd saves for backward during one training forward
    (loss included). Parameters are model state, not activations: they are left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = max(saved.get(st.data_ptr(), 0), st.nbytes())
        return t

    if pos is None:
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, pos, None, labels=tokens)
    loss.float().mean().backward()  # the graph (and any recompute) really runs
    return sum(saved.values())


def _activation_model(case: dict[str, Any], num_layers: int, cp: int = 1,
                      seq: int | None = None, attention: str = "auto"):
    import torch.nn.functional as F

    from toolkit.models import build_chunks, layer_spec, transformer_config

    a = ACT_MODEL
    recompute = {
        "none": {},
        "selective": dict(recompute_granularity="selective"),  # megatron's default: core_attn
        "full": dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1),
    }[case["recompute"]]
    config = transformer_config(
        num_layers=num_layers, hidden_size=a["hidden"], num_attention_heads=a["heads"],
        num_query_groups=a["kv_heads"], ffn_hidden_size=a["ffn"], normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=case["dropout"], attention_dropout=case["dropout"],
        tensor_model_parallel_size=case["tp"], sequence_parallel=case["sp"],
        context_parallel_size=cp, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        **recompute,
    )
    (model,) = build_chunks(config, layer_spec(normalization="RMSNorm", attention=attention),
                            vocab_size=a["vocab"], max_sequence_length=seq or a["seq"],
                            position_embedding_type="rope",
                            share_embeddings_and_output_weights=False)
    return model.train()


def measure_activations(cases: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per case: saved bytes of a 4-layer and a 2-layer model (their difference / 2 is exactly
    one decoder layer; the 4-layer total adds embedding, final norm, logits and loss)."""
    from toolkit import parallel
    from toolkit.parallel import ParallelLayout

    tokens = torch.randint(0, ACT_MODEL["vocab"], (ACT_MODEL["micro"], ACT_MODEL["seq"]),
                           generator=torch.Generator().manual_seed(SEED))
    out = {}
    for case in cases:
        parallel.initialize(ParallelLayout(tp=case["tp"], sequence_parallel=case["sp"]),
                            seed=SEED)
        try:
            out[case["name"]] = {f"layers{n}": saved_bytes_of_forward(
                _activation_model(case, n), tokens) for n in (4, 2)}
        finally:
            parallel.destroy()
    return out


# Context parallelism: the same Llama-like layers at a long-ish sequence, cp=1 (every rank the
# whole sequence) against cp=2 (each rank its two load-balanced chunks, megatron-core's
# get_batch_on_this_cp_rank). Both through SDPA: the CP attention calls SDPA, so cp=1 uses the
# SDPA core attention too (megatron-core's local path would add its s x s scores at cp=1 only).
CP_SEQ = 4096


def measure_cp_activations(cps: list[int]) -> dict[int, dict[str, int]]:
    """Per cp: this rank's saved bytes of a 4-layer and a 2-layer model in one forward of one
    sequence of ``CP_SEQ`` tokens (this rank's share of it at cp > 1)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from toolkit import parallel
    from toolkit.parallel import ParallelLayout

    tokens = torch.randint(0, ACT_MODEL["vocab"], (1, CP_SEQ),
                           generator=torch.Generator().manual_seed(SEED))
    case = dict(tp=1, sp=False, recompute="none", dropout=0.0)
    out = {}
    for cp in cps:
        parallel.initialize(ParallelLayout(cp=cp), seed=SEED)
        try:
            pos = torch.arange(CP_SEQ).unsqueeze(0)
            cut = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": pos})
            out[cp] = {f"layers{n}": saved_bytes_of_forward(
                _activation_model(case, n, cp=cp, seq=CP_SEQ, attention="sdpa"), cut["tokens"],
                cut["position_ids"]) for n in (4, 2)}
        finally:
            parallel.destroy()
    return out
