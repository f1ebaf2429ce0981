"""Rank functions for ZeRO++ (tests/test_zeropp.py): real DeepSpeed engines on CPU gloo ranks.

- ``engine_checks``: a tiny HF Llama under plain ZeRO-3 and under hpZ, one engine after the other
  in the same ranks: the losses, the bytes the rank holds (memory_checks' count, hpZ's secondary
  partitions included) and every collective of the second step counted by group size at
  DeepSpeed's communication backend (what the planner's traffic model predicts); then qwZ and
  qgZ, which DeepSpeed cannot run on CPU: their error is returned.
- ``quantized_checks``: qwZ + qgZ against plain ZeRO-3 where the kernels exist (GPU,
  tests/test_gpu_zeropp.py).
- ``trainer_checks_zeropp``: mdtk's trainer at dp4 with ZeRO-3 and with ZeRO-3 + hpZ 2, and the
  refusals of what cannot run here (qwZ on CPU, hpZ with tensor parallelism).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any

from dist_checks import memory_checks as mc
from dist_checks import trainer_checks as tc

MICRO, GAS = 2, 2
STEPS = 3  # trainer steps: the first losses of the parity check


def ds_config(world: int, dtype: str, **zeropp: Any) -> dict[str, Any]:
    """ZeRO-3 with small buckets; ``stage3_max_reuse_distance`` 0 so the backward gathers the
    parameters again (the tiny model would otherwise keep them all from its forward)."""
    cfg = {
        "train_batch_size": MICRO * GAS * world, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3, "reduce_bucket_size": 20000, "allgather_bucket_size": 20000,
            "stage3_prefetch_bucket_size": 20000, "stage3_param_persistence_threshold": 1000,
            "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 30000, **zeropp},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


@contextmanager
def counting_collectives(log: list[tuple[str, int, int]], on: dict[str, bool]):
    """Record (operation, group size, bytes of its largest tensor) of every collective DeepSpeed
    issues through its communication backend while ``on["on"]``."""
    import torch
    import torch.distributed as dist
    from deepspeed.comm import comm

    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
             "all_reduce", "all_gather", "reduce_scatter", "broadcast")
    backend = comm.cdb
    originals = {n: getattr(backend, n) for n in names}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if on["on"]:
                group = kwargs.get("group")
                for a in args:
                    group = a if isinstance(a, dist.ProcessGroup) else group
                values = list(args) + list(kwargs.values())
                tensors = [t for t in values if isinstance(t, torch.Tensor)]
                tensors += [t for v in values if isinstance(v, (list, tuple)) for t in v
                            if isinstance(t, torch.Tensor)]
                size = max((t.numel() * t.element_size() for t in tensors), default=0)
                log.append((name, dist.get_world_size(group), size))
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(backend, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(backend, name, fn)


def run_engine(config: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    """Train ``steps`` steps of GAS micro-batches; losses, bytes held before the last
    ``step()`` (memory_checks' count), hpZ's secondary bytes, and the last step's collectives
    summed by operation and group size."""
    import deepspeed
    import torch.distributed as dist

    from toolkit import runtime

    runtime.prepare_deepspeed()
    model = mc.tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(config),
                                      model_parameters=model.parameters())
    tokens, labels = (t.to(engine.device) for t in
                      mc._batch(model.config.vocab_size, MICRO, seed=dist.get_rank()))
    log: list[tuple[str, int, int]] = []
    on = {"on": False}
    losses, held, secondary = [], 0, 0
    with counting_collectives(log, on):
        for step in range(steps):
            on["on"] = step == steps - 1
            for micro in range(GAS):
                loss = engine(input_ids=tokens, labels=labels).loss
                engine.backward(loss)
                if on["on"] and micro == GAS - 1:
                    on["on"] = False  # the step's own gathers of persistent params aside
                    held = mc.held_bytes(engine)
                    secondary = sum(p.ds_secondary_tensor.untyped_storage().nbytes()
                                    for p in engine.module.parameters()
                                    if getattr(p, "ds_secondary_tensor", None) is not None)
                engine.step()
            losses.append(float(loss.detach()))
    engine.destroy()
    traffic: dict[str, list[int]] = {}
    for name, size, nbytes in log:
        calls, total = traffic.get(f"{name}@{size}", [0, 0])
        traffic[f"{name}@{size}"] = [calls + 1, total + nbytes]
    return {"losses": losses, "held_bytes": held, "secondary_bytes": secondary,
            "traffic": traffic}


def refused(config: dict[str, Any]) -> str:
    """DeepSpeed's error for a config it cannot run here (one step), or "" if it ran."""
    try:
        run_engine(config, steps=1)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    return ""


def engine_checks(world: int, hpz: int, dtype: str = "fp32") -> dict[str, Any]:
    """Plain ZeRO-3 and hpZ in ``dtype`` (losses, memory, traffic), then qwZ and qgZ."""
    from toolkit import parallel

    out: dict[str, Any] = {}
    for name, extra in (("plain", {}), ("hpz", {"zero_hpz_partition_size": hpz})):
        out[name] = run_engine(ds_config(world, dtype, **extra))
        parallel.destroy()  # DeepSpeed keeps the hpZ group until its groups are destroyed
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        out[key] = refused(ds_config(world, "bf16", **{key: True}))
        parallel.destroy()
    return out


def quantized_checks(world: int = 1) -> dict[str, Any]:
    """On GPUs (DeepSpeed's quantizer kernels): bf16 ZeRO-3 plain, then with qwZ + qgZ."""
    from toolkit import parallel

    out: dict[str, Any] = {}
    for name, extra in (("plain", {}), ("quantized", {"zero_quantized_weights": True,
                                                       "zero_quantized_gradients": True})):
        out[name] = run_engine(ds_config(world, "bf16", **extra), steps=3)
        parallel.destroy()
    return out


def trainer_checks_zeropp(assets: dict[str, str], workdir: str) -> dict[str, Any]:
    """mdtk's trainer: dp4 ZeRO-3 with and without hpZ 2 (and what the run used), then the
    refusals of qwZ on CPU and hpZ at tp2 (before any engine)."""
    out: dict[str, Any] = {}
    for case in (tc.Case("zero3_dp4", zero=3, steps=STEPS),
                 tc.Case("zero3_dp4_hpz2", zero=3, steps=STEPS,
                         overrides=("deepspeed.hpz_partition_size=2",))):
        seen: dict[str, Any] = {}  # one per case: a value left by the previous case is not kept
        with spying(seen):
            out[case.name] = tc.run_case(case, assets, workdir)
        out[case.name]["used"] = seen
    refusals = (tc.Case("refuse_qwz_cpu", zero=3,
                        overrides=("deepspeed.quantized_weights=true",)),
                tc.Case("refuse_hpz_tp2", zero=3, tp=2,
                        overrides=("deepspeed.hpz_partition_size=2",)),
                tc.Case("refuse_zero2_pp2", zero=2, pp=2))
    out["refusals"] = tc.refusals(list(refusals), assets, workdir)
    return out


@contextmanager
def spying(seen: dict[str, Any]):
    """Record the DeepSpeed config the trainer built its engine with, DeepSpeed's hpZ group size
    and how many parameters held a secondary partition before the first optimizer step."""
    from deepspeed.utils import groups

    from toolkit.train import trainer

    original = trainer.build_engine

    def spy(chunks, mpu, ds_config, **kw):
        engine = original(chunks, mpu, ds_config, **kw)
        seen["zero"] = dict(ds_config["zero_optimization"])
        group = groups._get_zero_param_intra_parallel_group()
        seen["hpz_group"] = 1 if group is None else \
            groups._get_zero_param_intra_parallel_group_world_size()
        step = engine.step

        def first_step(*args, **kwargs):
            if "secondary_params" not in seen:
                seen["secondary_params"] = sum(
                    getattr(p, "ds_secondary_tensor", None) is not None
                    for p in engine.module.parameters())
            return step(*args, **kwargs)

        engine.step = first_step
        return engine

    trainer.build_engine = spy
    try:
        yield
    finally:
        trainer.build_engine = original
