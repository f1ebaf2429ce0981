"""What the training engine can run: the DeepSpeed config combinations it refuses up front
(``check_supported``, each with the reason) and the optimizer defaults it adds. Pure functions of
the config (no torch), so the trainer checks a run before it builds anything and the planner
states the same rules (``toolkit.planner.search.zero_allowed``)."""

from __future__ import annotations

from typing import Any

from toolkit.errors import UserError


class EngineError(UserError):
    """A layout / DeepSpeed config / step argument combination the engine cannot run."""


def zero_stage(ds_config: dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def optimizer_on_host(ds_config: dict[str, Any]) -> bool:
    """Whether the config offloads the optimizer states (to cpu or nvme): DeepSpeed then steps
    them on the host with its CPU Adam. (Whether a checkpoint swapped them to NVMe is
    ``toolkit.checkpoint.nvme_swap``'s question.)"""
    device = ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device")
    return device not in (None, "none")


def check_supported(ds_config: dict[str, Any], *, pp: int, has_experts: bool = False) -> None:
    """Refuse combinations that do not train correctly, before any engine is built."""
    stage = zero_stage(ds_config)
    if stage not in (0, 1, 2, 3):
        raise EngineError(f"zero_optimization.stage={stage}: choose 0, 1, 2 or 3.")
    if has_experts and stage == 3:
        raise EngineError(
            "ZeRO stage 3 with megatron-core experts (ep/MoE) is not supported: DeepSpeed's "
            "ZeRO-3 partitions expert parameters through its own MoE modules only. "
            "Use zero_stage 1 or 2 for MoE models."
        )
    clipping = float(ds_config.get("gradient_clipping", 1.0)) > 0  # DeepSpeed's default is 1.0
    if stage == 0 and clipping and (pp > 1 or has_experts):
        raise EngineError(
            "ZeRO stage 0 with gradient clipping and "
            + ("pp>1" if pp > 1 else "experts")
            + " is not supported because DeepSpeed's ZeRO-0 clipping norm counts non-tensor-"
            "parallel weights on rank 0 of the tp x pp group only (dropping later pipeline "
            "stages) and averages expert norms instead of summing them. Use zero_stage 1 "
            "(same memory for weights, sharded optimizer states) or gradient_clipping: 0."
        )
    if ds_config.get("fp16", {}).get("enabled"):
        raise EngineError(
            "fp16 is not supported by the training engine: DeepSpeed's loss scaling happens in "
            "engine.backward, which megatron-core's schedules bypass. Use bf16 (or fp32)."
        )
    grad_accum = str(ds_config.get("data_types", {}).get("grad_accum_dtype", "")).lower()
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    if bf16 and stage == 1 and grad_accum in ("fp32", "float32") and not optimizer_on_host(
            ds_config):
        raise EngineError(
            "bf16 with zero_stage 1 and data_types.grad_accum_dtype=fp32 selects DeepSpeed's "
            "BF16_Optimizer, which accumulates gradients in engine.backward (bypassed by "
            "megatron-core's schedules). Drop grad_accum_dtype or use zero_stage 2."
        )
    if stage == 3 and pp > 1:
        raise EngineError(
            "ZeRO stage 3 with pp>1 is not supported because DeepSpeed's ZeRO-3 assumes every "
            "rank runs the same modules: its parameter coordinator checks the module trace with "
            "collectives over the whole world at the start of each forward (pipeline stages hold "
            "different modules and run forwards at different times, so the ranks deadlock), it "
            "computes the grad norm over a different number of parameter sub-groups per stage, "
            "and it counts the tied embedding of the first and last stage twice. "
            "Use zero_stage 1 or 2 with pp>1 (they partition optimizer states and gradients over "
            "the data-parallel group), or pp=1 for ZeRO-3."
        )


def with_optimizer_defaults(ds_config: dict[str, Any], *, cuda: bool = False) -> dict[str, Any]:
    """A copy of ``ds_config`` whose Adam/AdamW uses torch's implementation unless offloading,
    on CUDA its fused kernel (``cuda``).

    DeepSpeed otherwise JIT-compiles FusedAdam (~45 s on a cold CPU machine, CUDA-only kernels
    elsewhere); with optimizer offload it must be DeepSpeed's CPU Adam, so ``torch_adam`` stays off.
    DeepSpeed passes the other params to ``torch.optim.AdamW``, where ``fused: true`` is one
    kernel per step instead of the foreach chain (several passes over every fp32 state: the
    largest part of ZeRO's fixed cost per step on the H100, docs/benchmarks.md).
    """
    config = {**ds_config}
    opt = config.get("optimizer")
    if opt and str(opt.get("type", "")).lower() in ("adam", "adamw"):
        params = {**opt.get("params", {})}
        if optimizer_on_host(config):
            if params.get("torch_adam"):
                raise EngineError(
                    "optimizer.params.torch_adam=true with offload_optimizer: DeepSpeed needs its "
                    "CPU Adam for offloaded optimizer states; remove torch_adam."
                )
        else:
            params.setdefault("torch_adam", True)
            if cuda and params["torch_adam"] and "foreach" not in params:
                params.setdefault("fused", True)
        config["optimizer"] = {**opt, "params": params}
    return config
