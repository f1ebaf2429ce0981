"""Device and communication backend selection: the only place that knows CPU from CUDA."""

from __future__ import annotations

import datetime
import os
import warnings

import torch

from toolkit.runtime import cpu_compat

# megatron-core warns at import on every machine without TE/apex; mdtk says so once in `mdtk env`.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")


def use_cuda() -> bool:
    """CUDA unless it is missing or the user forces CPU with MDTK_DEVICE=cpu."""
    return os.environ.get("MDTK_DEVICE", "").lower() != "cpu" and torch.cuda.is_available()


def device() -> torch.device:
    if use_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if use_cuda() else "gloo"


def enable_cpu_mode() -> bool:
    """Make megatron-core and DeepSpeed run on CPU when CUDA is not used. Idempotent.

    Returns True when the CPU redirects are active.
    """
    if use_cuda():
        return False
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if torch.cuda.is_available():
        # MDTK_DEVICE=cpu on a CUDA machine: megatron-core still calls CUDA, which works there.
        return False
    return cpu_compat.enable()


def have_transformer_engine() -> bool:
    """Transformer Engine's torch extension imports (it needs CUDA)."""
    if not use_cuda():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def init_distributed(timeout_s: int = 600) -> None:
    """Initialise torch.distributed from the launcher's env vars (torchrun, deepspeed, srun)."""
    if torch.distributed.is_initialized():
        return
    _env_from_slurm()
    if use_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(
        backend=backend(), timeout=datetime.timedelta(seconds=timeout_s)
    )


def _env_from_slurm() -> None:
    """srun sets SLURM_* but not the torch variables; fill them in when missing."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_NODELIST", "")
        os.environ["MASTER_ADDR"] = _first_slurm_host(nodelist) or "127.0.0.1"


def _first_slurm_host(nodelist: str) -> str:
    """'node[03-05,7],gpu1' -> 'node03' without calling scontrol."""
    if not nodelist:
        return ""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    first = rest.split(",")[0].split("-")[0].rstrip("]")
    return prefix + first


def prepare_deepspeed() -> None:
    """Set DeepSpeed up for this device before ``deepspeed.initialize``.

    On CPU: the CPU accelerator, gloo, and no shared-memory comm op (it is JIT-compiled at every
    ``initialize`` on CPU, ~30 s on a cold machine, and gloo does the same job for mdtk's sizes).
    """
    enable_cpu_mode()
    import deepspeed

    if not use_cuda():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    init_distributed()
    deepspeed.init_distributed(dist_backend=backend())
