"""The DeepSpeed JSON of a run: generated from the memory model or the user's file (both through
``toolkit.dsconfig.training``), with the engine's rules (``engine_rules.check_supported``)
checked once, before anything is sized or built."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from toolkit import runtime
from toolkit.errors import ConfigError
from toolkit.train.config import RunPlan, TrainConfig
from toolkit.train.loop.engine_rules import check_supported
from toolkit.train.model import RunModel

if TYPE_CHECKING:
    from toolkit.dsconfig.generator import Request


def device_memory() -> tuple[int, int]:
    """(memory of one device, host RAM of this node) in bytes."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if runtime.use_cuda():
        import torch

        return torch.cuda.get_device_properties(0).total_memory, host
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return host // max(local, 1), host  # CPU ranks share the host's RAM


def deepspeed_config(cfg: TrainConfig, run: RunPlan, model: RunModel,
                     total_steps: int) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed JSON for this run and the reasons it was chosen, from the dsconfig package.

    ``deepspeed.config: auto`` asks the generator (memory model; stage/offload as configured or
    chosen); a path is the user's JSON. Either way the trainer's keys (batch split, clipping,
    optimizer, precision) are set and the result is linted (``toolkit.dsconfig.training``).
    The engine's rules are checked once: before the generator sizes anything when the stage is
    given (all they read is then known: stage, precision, clipping), else on the final JSON.
    """
    from toolkit.dsconfig.training import TrainerKeys, trainer_config

    ds = cfg.deepspeed
    user = bool(ds.config and ds.config != "auto")
    known_early = not user and ds.zero_stage != "auto"
    if known_early:  # refuse what the engine cannot run before sizing anything
        _check_engine_rules({"zero_optimization": {"stage": int(ds.zero_stage)},
                             "fp16": {"enabled": cfg.train.precision == "fp16"},
                             "gradient_clipping": cfg.optim.clip_grad}, run, model)
    o = cfg.optim
    keys = TrainerKeys(micro_batch=run.micro_batch, global_batch=run.global_batch,
                       grad_accum=run.grad_accum, clip_grad=o.clip_grad, lr=o.lr,
                       weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                       precision=cfg.train.precision)
    source = ds.config if user else generator_request(cfg, run, model, total_steps)
    try:
        config, notes = trainer_config(source, keys, run.layout, local_size(run.layout.world_size))
    except ValueError as e:  # dsconfig's ConfigError, or a file that is not a JSON object
        where = f"deepspeed.config={ds.config}" if user else "deepspeed"
        raise ConfigError(f"{where}: {e}") from e
    if not known_early:
        _check_engine_rules(config, run, model)
    return config, notes


def _check_engine_rules(ds_config: dict[str, Any], run: RunPlan, model: RunModel) -> None:
    check_supported(ds_config, pp=run.layout.pp, has_experts=model.has_experts, configs=True)


def generator_request(cfg: TrainConfig, run: RunPlan, model: RunModel,
                      total_steps: int) -> Request:
    """What the generator needs to choose: the model, this machine's memory, the run's shape."""
    from toolkit.dsconfig.generator import Request
    from toolkit.memory import Cluster, TrainShape
    from toolkit.train.objectives.spec import engine_reserve, train_shape_fields

    ds, world = cfg.deepspeed, run.layout.world_size
    gpu_mem, host = device_memory()
    local = local_size(world)
    cluster = Cluster(nodes=max(world // local, 1), gpus_per_node=local,
                      gpu_mem=gpu_mem, cpu_mem=host, nvme_path=ds.nvme_path)
    warmup = max(cfg.optim.warmup_steps, 1)
    return Request(
        model=model.shape, cluster=cluster,
        train=TrainShape(seq_len=cfg.train.seq_len, micro_batch=run.micro_batch,
                         global_batch=run.global_batch, dtype=cfg.train.precision,
                         recompute=cfg.train.recompute,
                         async_checkpoint=cfg.checkpoint.async_,
                         **train_shape_fields(cfg)),
        layout=run.layout, stage=str(ds.zero_stage), offload=ds.offload, lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay, betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps, gradient_clipping=cfg.optim.clip_grad,
        warmup_steps=warmup, total_steps=max(total_steps, warmup + 1),
        hpz=ds.hpz_partition_size, quantized_weights=ds.quantized_weights,
        quantized_gradients=ds.quantized_gradients,
        gpu_reserve=Request.gpu_reserve + engine_reserve(cfg, gpu_mem),
    )


def local_size(world: int) -> int:
    """Ranks of this run on one node (the launcher's LOCAL_WORLD_SIZE; the world without one)."""
    return min(int(os.environ.get("LOCAL_WORLD_SIZE", world)), world)
