"""What this machine can run: versions, device, backend, optional accelerated pieces."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
from dataclasses import dataclass, field


@dataclass
class EnvReport:
    versions: dict[str, str]
    device: str
    backend: str
    optional: dict[str, str]
    cpu_patches: list[str] = field(default_factory=list)


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _importable(module: str) -> str:
    try:
        importlib.import_module(module)
        return "available"
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return f"missing ({type(e).__name__})"


def _ds_op(builder_name: str) -> str:
    """Whether a DeepSpeed op can be built here, and whether it is already compiled."""
    try:
        from deepspeed.ops import op_builder

        builder = getattr(op_builder, builder_name)()
        if type(builder).__name__ == "NotImplementedBuilder":
            return "not implemented on this accelerator"
        if not builder.is_compatible(verbose=False):
            return "not buildable here"
        ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR", "")
        built = ext_dir and any(
            name.startswith(builder.name) for name in os.listdir(ext_dir)
        ) if ext_dir and os.path.isdir(ext_dir) else False
        return "compiled (cached)" if built else "buildable (JIT on first use)"
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__}: {e})"


def collect() -> EnvReport:
    from toolkit import runtime

    cpu_patches: list[str] = []
    if runtime.use_cuda():
        import torch

        n = torch.cuda.device_count()
        device = f"cuda ({n} x {torch.cuda.get_device_name(0)})"
    else:
        device = "cpu"
        runtime.enable_cpu_mode()
        from toolkit.runtime import cpu_compat

        cpu_patches = list(cpu_compat.PATCHED)
    versions = {d: _version(d) for d in
                ("torch", "megatron-core", "deepspeed", "transformers", "safetensors",
                 "datasets", "accelerate")}
    optional = {
        "transformer_engine": _importable("transformer_engine.pytorch"),
        "apex": _importable("apex"),
        "flash_attn": _importable("flash_attn"),
        "deepspeed cpu_adam": _ds_op("CPUAdamBuilder"),
        "deepspeed async_io (NVMe)": _ds_op("AsyncIOBuilder"),
        "deepspeed fused_adam": _ds_op("FusedAdamBuilder"),
        "deepspeed quantizer (ZeRO++ qwZ/qgZ)": _ds_op("QuantizerBuilder"),
    }
    return EnvReport(versions, device, runtime.backend(), optional, cpu_patches)
