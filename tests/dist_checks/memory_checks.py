"""Rank functions: real DeepSpeed engines on CPU/gloo, measured against the memory model.

A tiny HF Llama (random weights) is trained with a given DeepSpeed config. After one full step,
the next step's forward/backward runs and, before its ``step()``, every tensor the rank holds is
counted: module parameters (and stage-3 partitions), gradients, and every tensor reachable from
the engine's optimizer object (flat 16-bit groups, fp32 partitions, Adam state, buckets).
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
        for extra in (obj.grad, getattr(obj, "ds_tensor", None)):
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
                      **model_overrides: Any) -> dict[str, Any]:
    """Train ``steps`` steps on a fixed batch; return losses and the bytes held before the
    last step's optimizer update (gradients and optimizer states both alive)."""
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
    engine.destroy()
    del engine
    return {"losses": losses, "held_bytes": measured}
