"""Rank functions for the foundation's layout-parity checks on real megatron-core GPTModels.

Each check builds a full (tp=pp=ep=1) reference model on every rank, computes its loss and
gradients, then builds the layout under test, copies the reference weights into it (sliced for
this rank) and compares loss and every gradient slice. The reference is the same model in one
piece, so any layout bug shows as a numeric difference.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from toolkit import parallel
from toolkit.models import build_chunks, layer_spec, transformer_config
from toolkit.parallel import ParallelLayout
from toolkit.parallel.grads import finalize_grads

VOCAB, SEQ, SEED = 128, 16, 1234
LR, CLIP = 1e-2, 1.0


def tiny_config(layout: ParallelLayout, *, num_experts: int | None = None):
    # MoE families (Mixtral, Qwen-MoE) have no expert biases; megatron-core's expert MLP also
    # rejects them at tp=1 (in-place add on a custom-Function view).
    moe = {}
    if num_experts:
        moe = dict(num_moe_experts=num_experts, moe_router_topk=2, moe_aux_loss_coeff=0.0,
                   moe_token_dispatcher_type="allgather", moe_ffn_hidden_size=96,
                   moe_router_load_balancing_type="none", add_bias_linear=False)
    return transformer_config(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, normalization="LayerNorm",
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep, sequence_parallel=layout.sequence_parallel,
        pipeline_dtype=torch.float32, params_dtype=torch.float32,
        **{"add_bias_linear": True, **moe},
    )


def build(layout: ParallelLayout, *, num_experts: int | None = None, tied: bool = True,
          attention: str | None = None):
    config = tiny_config(layout, num_experts=num_experts)
    spec = layer_spec(normalization="LayerNorm", num_experts=num_experts, attention=attention)
    return build_chunks(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                        position_embedding_type="rope",
                        share_embeddings_and_output_weights=tied)


def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def lm_loss(model, tokens, labels) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, pos, None, labels=labels).float().mean()


# -- reference model and weight slicing (test glue; the real mapping lives in the adapters) ----

def _global_name(chunk, name: str) -> str:
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"
    m = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", name)
    if m:
        n_local = len(chunk.decoder.layers[0].mlp.experts.local_experts)
        e = ps.get_expert_model_parallel_rank() * n_local + int(m.group(2))
        name = f"{m.group(1)}{e}{m.group(3)}"
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        name = "embedding.word_embeddings.weight"
    return name


def _local_slice(param, full: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    expert = getattr(param, "allreduce", True) is False
    rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
    dim, size = param.partition_dim, param.shape[param.partition_dim]
    return full.narrow(dim, rank * size, size)


def load_from_full(chunks, full: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                p.copy_(_local_slice(p, full[_global_name(chunk, name)]))


def grad_diff(chunks, full_grads: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            ref = _local_slice(p, full_grads[_global_name(chunk, name)])
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            worst = max(worst, (got - ref).abs().max().item())
    return worst


def reference(num_experts=None, n_micro=1, micro=2, seed=0, tied=True):
    """Full model on this rank: weights, mean loss over micro-batches, and gradients."""
    mpu = parallel.initialize(ParallelLayout(), seed=SEED)
    del mpu
    (model,) = build(ParallelLayout().resolve(dist.get_world_size()), num_experts=num_experts,
                     tied=tied)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()
               if not k.endswith("_extra_state")}
    tokens, labels = batch(n_micro * micro, seed)
    losses = []
    for i in range(n_micro):
        sl = slice(i * micro, (i + 1) * micro)
        loss = lm_loss(model, tokens[sl], labels[sl])
        (loss / n_micro).backward()
        losses.append(loss.item())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    parallel.destroy()
    return weights, sum(losses) / n_micro, grads


# -- checks run on ranks ------------------------------------------------------------------------

def check_tensor_parallel(sequence_parallel: bool, attention: str | None = None) -> dict:
    """tp=2 (optionally SP, optionally another core attention) vs the tp=1 local-attention model."""
    weights, ref_loss, ref_grads = reference()
    layout = ParallelLayout(tp=2, sequence_parallel=sequence_parallel)
    parallel.initialize(layout, seed=SEED)
    chunks = build(layout.resolve(dist.get_world_size()), attention=attention)
    load_from_full(chunks, weights)
    tokens, labels = batch(2)
    loss = lm_loss(chunks[0], tokens, labels)
    loss.backward()
    finalize_grads(chunks)
    out = {"ref_loss": ref_loss, "loss": loss.item(), "grad_diff": grad_diff(chunks, ref_grads),
           "n_params": sum(p.numel() for p in chunks[0].parameters()),
           "full_params": sum(v.numel() for v in weights.values()),
           "core": type(chunks[0].decoder.layers[0].self_attention.core_attention).__name__}
    parallel.destroy()
    return out


def check_pipeline(vpp: int | None) -> dict:
    n_micro, micro = 4, 2
    weights, ref_loss, ref_grads = reference(n_micro=n_micro, micro=micro)
    layout = ParallelLayout(pp=2, vpp=vpp)
    parallel.initialize(layout, seed=SEED)
    chunks = build(layout.resolve(dist.get_world_size()))
    load_from_full(chunks, weights)
    tokens, labels = batch(n_micro * micro)

    def micro_batches():
        for i in range(n_micro):
            sl = slice(i * micro, (i + 1) * micro)
            yield tokens[sl], labels[sl]

    def forward_step(data_iterator, model):
        tok, lab = next(data_iterator)
        pos = torch.arange(tok.shape[1]).unsqueeze(0).expand_as(tok)
        out = model(tok, pos, None, labels=lab)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    iters = [micro_batches() for _ in chunks] if len(chunks) > 1 else micro_batches()
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters,
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=n_micro,
        seq_length=SEQ, micro_batch_size=micro, forward_only=False,
    )
    finalize_grads(chunks)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    loss = sum(r["loss"].item() for r in results) / n_micro if last else None
    out = {"ref_loss": ref_loss, "loss": loss, "grad_diff": grad_diff(chunks, ref_grads),
           "chunks": len(chunks), "layers": sum(len(c.decoder.layers) for c in chunks)}
    parallel.destroy()
    return out


def check_expert_parallel(tp: int = 1) -> dict:
    """ep=2 (and ep=2 x tp=2 with sequence parallelism, which megatron-core needs for MoE+TP)."""
    data_rank = dist.get_rank() // tp  # ranks of one TP group see the same tokens
    weights, ref_loss, ref_grads = reference(num_experts=4, seed=data_rank)
    # With EP each expert sees every data rank's tokens: its gradient is the sum of the
    # per-data-rank reference gradients. Other weights see only this rank's tokens.
    expert_grads = {n: g.clone() for n, g in ref_grads.items() if ".local_experts." in n}
    for g in expert_grads.values():
        dist.all_reduce(g)
        g.div_(tp)
    ref_grads.update(expert_grads)
    layout = ParallelLayout(ep=2, tp=tp, sequence_parallel=tp > 1)
    parallel.initialize(layout, seed=SEED)
    chunks = build(layout.resolve(dist.get_world_size()), num_experts=4)
    load_from_full(chunks, weights)
    tokens, labels = batch(2, seed=data_rank)
    loss = lm_loss(chunks[0], tokens, labels)
    loss.backward()
    finalize_grads(chunks)
    out = {"ref_loss": ref_loss, "loss": loss.item(), "grad_diff": grad_diff(chunks, ref_grads),
           "local_experts": len(chunks[0].decoder.layers[0].mlp.experts.local_experts)}
    parallel.destroy()
    return out


def check_deepspeed_zero(stages: list[int], steps: int = 3) -> dict:
    """dp=2 x tp=2 inside a real DeepSpeed engine vs the full model trained with torch AdamW."""
    import deepspeed

    from toolkit import runtime

    lr, global_batch, micro = LR, 4, 2
    tokens, labels = batch(global_batch)
    weights, _, _ = reference()
    parallel.initialize(ParallelLayout(), seed=SEED)
    (ref,) = build(ParallelLayout().resolve(dist.get_world_size()))
    ref.load_state_dict(weights, strict=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)
    ref_losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(ref, tokens, labels)
        loss.backward()
        # DeepSpeed clips at 1.0 unless told otherwise; clipping here too checks that the
        # engine computes the gradient norm over the tp x pp group correctly through the mpu.
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        ref_losses.append(loss.item())
    parallel.destroy()

    runtime.prepare_deepspeed()
    layout = ParallelLayout(tp=2)
    out = {"ref": ref_losses}
    for stage in stages:
        mpu = parallel.initialize(layout, seed=SEED)
        (model,) = build(mpu.layout)
        load_from_full([model], weights)
        config = {
            "train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW",
                          "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
            "gradient_clipping": CLIP,
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config, mpu=mpu)
        dp_rank = mpu.get_data_parallel_rank()
        sl = slice(dp_rank * micro, (dp_rank + 1) * micro)
        losses = []
        for _ in range(steps):
            loss = lm_loss(engine, tokens[sl], labels[sl])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=mpu.get_data_parallel_group())
            losses.append(mean.item() / mpu.get_data_parallel_world_size())
        out[stage] = losses
        engine.destroy()
        parallel.destroy()
    return out


def check_initialize_rejects(layout: ParallelLayout) -> str:
    """A layout that does not fit the real world size fails on every rank, before any group."""
    try:
        parallel.initialize(layout)
    except parallel.LayoutError as e:
        return str(e)
    parallel.destroy()
    return "accepted"


def check_mpu(layout: ParallelLayout) -> dict:
    """The sizes and ranks DeepSpeed reads through the mpu adapter."""
    mpu = parallel.initialize(layout)
    out = {
        "rank": dist.get_rank(),
        "tp": (mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()),
        "pp": (mpu.get_pipe_parallel_world_size(), mpu.get_pipe_parallel_rank()),
        "dp": (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()),
        "mp": (mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()),
        "dp_ranks": mpu.get_data_parallel_group_ranks(),
    }
    parallel.destroy()
    return out


def check_layout_cycles_release_threads(cycles: int = 4) -> list[int]:
    """Threads of this process after each initialize -> collective on every group -> destroy."""
    import os

    counts = []
    for _ in range(cycles):
        mpu = parallel.initialize(ParallelLayout(tp=2))
        for group in (mpu.get_tensor_model_parallel_group(), mpu.get_data_parallel_group(),
                      ps.get_embedding_group(), ps.get_model_parallel_group()):
            torch.distributed.all_reduce(torch.ones(1), group=group)
        parallel.destroy()
        counts.append(len(os.listdir(f"/proc/{os.getpid()}/task")))
    return counts


def check_engine_after_destroy_without_mpu() -> dict:
    """An engine over mdtk's mpu, torn down; then a plain DeepSpeed engine with no mpu (dp = all
    ranks) must build and step: DeepSpeed must not keep asking the destroyed layout for groups."""
    import deepspeed
    from deepspeed.utils import groups

    from toolkit import runtime

    runtime.prepare_deepspeed()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    mpu = parallel.initialize(ParallelLayout(tp=2), seed=SEED)
    (model,) = build(mpu.layout)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**config, "train_batch_size": 2}, mpu=mpu)
    held = groups.mpu is mpu
    engine.destroy()
    parallel.destroy()
    plain = torch.nn.Linear(8, 8)
    world = dist.get_world_size()
    engine, *_ = deepspeed.initialize(model=plain, model_parameters=plain.parameters(),
                                      config={**config, "train_batch_size": 2 * world})
    x = torch.ones(2, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    dp = engine.dp_world_size
    engine.destroy()
    return {"held": held, "dp": dp, "loss": loss.item()}
