"""Device and communication backend selection: the only place that knows CPU from CUDA."""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import warnings
from collections.abc import Iterable, Iterator

import torch

from toolkit.errors import UserError
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


def select_deepspeed_accelerator() -> None:
    """DS_ACCELERATOR=cpu when CUDA is not used, before anything imports DeepSpeed (transformers
    does): DeepSpeed otherwise warns, in every process, that it fell back to the CPU."""
    if not use_cuda():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def enable_cpu_mode() -> bool:
    """Make megatron-core and DeepSpeed run on CPU when CUDA is not used. Idempotent.

    Returns True when the CPU redirects are active. megatron-core's machine-independent bugs are
    fixed either way (``cpu_compat.fix_megatron_core``).
    """
    cpu_compat.fix_megatron_core()
    if use_cuda():
        return False
    select_deepspeed_accelerator()
    if torch.cuda.is_available():
        # MDTK_DEVICE=cpu on a CUDA machine: megatron-core still calls CUDA, which works there.
        return False
    _eager_on_cpu()
    return cpu_compat.enable()


def _eager_on_cpu() -> None:
    """megatron-core's fused helpers (``jit_fuser`` = torch.compile: MoE routing and experts,
    gated attention's output gate) run eagerly on CPU: a first compile builds C++ with the
    system compiler (4-7 s per process, measured) for element-wise ops that take microseconds.
    ``TORCH_COMPILE_DISABLE=0`` set by the user keeps torch.compile on."""
    if os.environ.get("TORCH_COMPILE_DISABLE") is not None:
        return
    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # read when torch._dynamo is imported
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # already imported: its config is read at each compiled call
        dynamo.config.disable = True


def have_transformer_engine() -> bool:
    """Transformer Engine's torch extension imports (it needs CUDA)."""
    if not use_cuda():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


#: What a launcher (torchrun, the deepspeed launcher; srun's SLURM_* translated) sets for a rank.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_alone_saved: dict[str, str | None] | None = None  # the env a world of one replaced


def init_distributed(timeout_s: int = 600) -> bool:
    """Initialise torch.distributed from the launcher's env vars (torchrun, deepspeed, srun).

    A process no launcher started (none of RANK, WORLD_SIZE, SLURM_PROCID set) joins a world of
    one instead: rank 0 of 1 on a free local port, so `mdtk train CFG` runs as one plain process
    as HF Trainer does. Returns True when this call made that world; its caller ends it with
    ``leave_world_of_one`` (or uses ``joined``). A partial launcher environment is refused,
    naming what is missing, instead of torch's rendezvous traceback.
    """
    if torch.distributed.is_initialized():
        return False
    _env_from_slurm()
    alone = not any(k in os.environ for k in ("RANK", "WORLD_SIZE"))
    if alone:
        _enter_world_of_one()
    elif missing := [k for k in LAUNCH_ENV if k not in os.environ]:
        raise UserError(f"the launcher's environment lacks {', '.join(missing)} (it has "
                        f"{', '.join(k for k in LAUNCH_ENV if k in os.environ)}): start the "
                        "ranks with `mdtk launch -n N -- ...` or torchrun, or unset RANK and "
                        "WORLD_SIZE to run as one process.")
    if use_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        torch.distributed.init_process_group(
            backend=backend(), timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        if alone:
            _restore_env()
        raise
    return alone


def _enter_world_of_one() -> None:
    """The environment torchrun gives a single rank, on a port that was free just now."""
    global _alone_saved
    from toolkit.runtime.ports import free_port

    values = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
              "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    _alone_saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)


def _restore_env() -> None:
    global _alone_saved
    for key, value in (_alone_saved or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _alone_saved = None


def alone() -> bool:
    """Whether this process runs in a world of one that ``init_distributed`` made."""
    return _alone_saved is not None


def leave_world_of_one() -> None:
    """End the world of one ``init_distributed`` made (its process group and environment), so the
    process can start another; nothing when the launcher's world is in use."""
    if _alone_saved is None:
        return
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _restore_env()


@contextlib.contextmanager
def joined(timeout_s: int = 600) -> Iterator[bool]:
    """torch.distributed for the block: the launch's world, or a world of one made for the
    block and ended after it (yields whether it is one)."""
    made = init_distributed(timeout_s)
    try:
        yield made or alone()
    finally:
        if made:
            leave_world_of_one()


@contextlib.contextmanager
def zero3_gathered(params: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """The ZeRO-3 partitions among ``params`` whole inside the block, to read (what is written
    to them is dropped when they are partitioned again); nothing to do for parameters ZeRO-3
    does not hold. Collective under ZeRO-3."""
    held = [p for p in params if hasattr(p, "ds_id")]
    if not held:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(held):
        yield


@contextlib.contextmanager
def failing_together() -> Iterator[None]:
    """Collective: run the block on every rank; if it raised on any rank, raise on every rank.

    A rank that fails alone leaves the others waiting in their next collective (a hang, or a
    gloo "connection closed" traceback once it exits). Around a block that runs no collective
    itself, every rank stops at the same point instead: a failing rank raises its own error, the
    others raise the lowest failing rank's ``UserError`` (same class and message, so rank 0 can
    report it once) or, for anything else (a bug), a RuntimeError naming that rank.
    """
    error: Exception | None = None
    try:
        yield
    except Exception as e:  # shared with the other ranks below, then raised
        error = e
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world == 1:
        if error is not None:
            raise error
        return
    gathered: list[object] = [None] * world
    torch.distributed.all_gather_object(gathered, _shareable(error))
    failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
    if error is not None:
        raise error
    if failed:
        rank, first = failed[0]
        if isinstance(first, UserError):
            raise first
        raise RuntimeError(f"rank {rank} failed: {first}")


def _shareable(error: Exception | None) -> object:
    """What another rank needs of ``error``: the UserError itself if it pickles, else its text."""
    if error is None:
        return None
    if isinstance(error, UserError):
        try:
            pickle.dumps(error)
            return error
        except Exception:  # an error class with extra constructor arguments
            return UserError(str(error))
    return f"{type(error).__name__}: {error}"


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

    On CPU: the CPU accelerator, gloo, no shared-memory comm op (it is JIT-compiled at every
    ``initialize`` on CPU, ~30 s on a cold machine, and gloo does the same job for mdtk's sizes),
    ZeRO-3 partitions in the model's dtype (``cpu_compat.patch_deepspeed``), and one CPU probe
    per process (``cpu_compat.cache_cpu_info``). On CUDA: a ``TORCH_CUDA_ARCH_LIST`` that
    DeepSpeed's JIT op builds can parse (``ops.prepare_cuda_arch_list``).
    """
    enable_cpu_mode()
    if use_cuda():
        from toolkit.runtime import ops

        ops.prepare_cuda_arch_list()
    import deepspeed

    if not use_cuda():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        cpu_compat.patch_deepspeed()
        cpu_compat.cache_cpu_info()
    init_distributed()
    deepspeed.init_distributed(dist_backend=backend())
