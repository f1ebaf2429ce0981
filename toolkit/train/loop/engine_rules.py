"""What the training engine can run: the DeepSpeed config combinations it refuses up front
(``check_supported``: the rules of ``toolkit.rules``, read from the DeepSpeed JSON) and the
optimizer defaults it adds. Pure functions of the config (no torch), so the trainer checks a run
before it builds anything."""

from __future__ import annotations

from typing import Any

from toolkit import rules
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


def setup_of(ds_config: dict[str, Any], *, pp: int, has_experts: bool = False) -> rules.Setup:
    """What ``toolkit.rules`` reads of a DeepSpeed config on ``pp`` pipeline stages."""
    grad_accum = str(ds_config.get("data_types", {}).get("grad_accum_dtype", "")).lower()
    precision = next((k for k in ("fp16", "bf16") if ds_config.get(k, {}).get("enabled")), "fp32")
    return rules.Setup(
        stage=zero_stage(ds_config), pp=pp, experts=has_experts,
        clipping=float(ds_config.get("gradient_clipping", 1.0)) > 0,  # DeepSpeed's default: 1.0
        precision=precision, grad_accum_fp32=grad_accum in ("fp32", "float32"),
        optimizer_offload=optimizer_on_host(ds_config))


def check_supported(ds_config: dict[str, Any], *, pp: int, has_experts: bool = False,
                    configs: bool = False) -> None:
    """Refuse combinations that do not train correctly, before any engine is built (the rules
    of ``toolkit.rules``): what the engine itself cannot run, as ``build_engine`` checks a config
    no generator or lint has seen; ``configs``: also what mdtk's configs leave out (ZeRO-2 with
    pp > 1), as the trainer checks its run."""
    problem = rules.training_problem(setup_of(ds_config, pp=pp, has_experts=has_experts),
                                     configs=configs)
    if problem is not None:
        raise EngineError(problem)


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
