"""Run megatron-core (and DeepSpeed next to it) on a CPU-only torch build.

megatron-core assumes CUDA in a handful of places: ``torch.cuda.current_device()`` used as a device,
literal ``device="cuda"`` factory calls, ``.cuda()``, the CUDA RNG state used by the tensor-parallel
RNG tracker, ``torch.cuda.synchronize()`` in the pipeline schedules, and a ``te_general_gemm``
name that is undefined without Transformer Engine. On a machine without CUDA none of these calls
can do anything useful (they raise), so redirecting them to their CPU equivalents changes no
behaviour a GPU user could observe. ``enable()`` is explicit, idempotent, and refuses to run when
CUDA is available: GPU runs never go through its redirects. The one exception is
``fix_megatron_core()``: the missing ``te_general_gemm`` breaks every MoE router without
Transformer Engine, on GPUs too (seen on an H100 with megatron-core 0.16.1), so it applies on
every machine.

DeepSpeed gets one fix on such a machine (``patch_deepspeed``, see there). What is patched is
recorded in ``PATCHED`` so ``mdtk env`` can show it. (``cache_cpu_info`` only saves time: one
answer of DeepSpeed's CPU probe per process.)
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch
import torch.utils._device

PATCHED: list[str] = []
_ENABLED = False  # the CPU redirects are in place
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
              "empty_strided", "zeros_like", "ones_like", "empty_like", "full_like")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_device_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # staging for a host-to-GPU copy (RoPE's CP slicing)
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    wrapper._mdtk_cpu_compat = True  # type: ignore[attr-defined]
    return wrapper


def _tensor_to(orig):
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        if args and _is_cuda(args[0]):
            args = ("cpu",) + args[1:]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return orig(self, *args, **kwargs)

    return to


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is already ordered; an event's time is
    the host clock when it was recorded (megatron-core's inference times its tokens with
    ``elapsed_time``)."""

    def __init__(self, *args, **kwargs):
        self._at = time.perf_counter()

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        self._at = time.perf_counter()

    def elapsed_time(self, end: _NullStream) -> float:
        """Milliseconds from this event to ``end``, as CUDA events report them."""
        return 1e3 * (end._at - self._at)

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


def _patch(obj: Any, name: str, value: Any, label: str) -> None:
    setattr(obj, name, value)
    if label not in PATCHED:
        PATCHED.append(label)


def enable() -> bool:
    """Apply the CPU redirects once. Returns True when active, False when CUDA is present."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    _ENABLED = True

    cpu_gen = torch.default_generator
    cuda = torch.cuda
    _patch(cuda, "current_device", lambda: "cpu", "torch.cuda.current_device -> 'cpu'")
    _patch(cuda, "synchronize", lambda *a, **k: None, "torch.cuda.synchronize -> no-op")
    _patch(cuda, "get_rng_state", lambda *a, **k: cpu_gen.get_state(),
           "torch.cuda.get_rng_state -> CPU generator")
    _patch(cuda, "set_rng_state", lambda state, *a, **k: cpu_gen.set_state(state),
           "torch.cuda.set_rng_state -> CPU generator")
    _patch(cuda, "manual_seed", lambda seed: cpu_gen.manual_seed(int(seed)),
           "torch.cuda.manual_seed -> CPU generator")
    _patch(cuda.random, "get_rng_state", cuda.get_rng_state, "torch.cuda.random.get_rng_state")
    _streams()
    _patch(torch.Tensor, "record_stream", lambda self, *a, **k: None, "Tensor.record_stream")

    # torch.device("meta") (used by transformers' loader) dispatches only the factories in a list
    # torch caches on first use: fill that cache with the real functions before wrapping them,
    # else models built under a device context get uninitialised buffers (e.g. RoPE inv_freq).
    torch.utils._device._device_constructors()
    for name in _FACTORIES:
        _patch(torch, name, _cpu_device_factory(getattr(torch, name)), f"torch.{name}(device=cuda)")
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self, "Tensor.cuda -> self")
    _patch(torch.nn.Module, "cuda", lambda self, *a, **k: self, "Module.cuda -> self")
    _patch(torch.Tensor, "to", _tensor_to(torch.Tensor.to), "Tensor.to(cuda) -> cpu")

    _patch_megatron()
    return True


def _streams() -> None:
    cuda = torch.cuda
    _patch(cuda, "Stream", _NullStream, "torch.cuda.Stream -> null stream")
    _patch(cuda, "Event", _NullStream, "torch.cuda.Event -> null event")
    _patch(cuda, "current_stream", lambda *a, **k: _NullStream(), "torch.cuda.current_stream")
    _patch(cuda, "stream", lambda *a, **k: contextlib.nullcontext(), "torch.cuda.stream")


def reassert_streams() -> None:
    """The null streams and events again, where a library replaced them after ``enable`` (vLLM's
    CPU worker does on import, with events that cannot time: megatron-core's engine times its
    tokens)."""
    if _ENABLED:
        _streams()


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mc_random

    _patch(mc_random, "_get_cuda_rng_state", lambda *a, **k: torch.default_generator.get_state(),
           "megatron tensor_parallel.random._get_cuda_rng_state -> CPU generator")
    _patch(mc_random, "_set_cuda_rng_state",
           lambda state, *a, **k: torch.default_generator.set_state(state),
           "megatron tensor_parallel.random._set_cuda_rng_state -> CPU generator")
    from megatron.core.inference import communication_utils as inference_comm

    def _is_on_device(tensor: torch.Tensor) -> None:  # the pipeline broadcasts of generation
        assert tensor is not None

    _patch(inference_comm, "_is_cuda", _is_on_device,
           "megatron inference communication_utils._is_cuda -> accepts CPU tensors")

    fix_megatron_core()


def fix_megatron_core() -> None:
    """megatron-core bugs that are not about CPUs (idempotent; any machine)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 references this name without defining it when TE is absent:
        # NameError in every MoE router's gating on CPU and GPU alike.
        _patch(moe_utils, "te_general_gemm", None, "megatron moe_utils.te_general_gemm = None")


def patch_deepspeed() -> None:
    """ZeRO-3 keeps the model's dtype for its parameter partitions. Idempotent.

    DeepSpeed 0.19.8's ``zero.Init._set_dtype`` reads ``dtype or float16 if fp16_supported else
    bfloat16 ...``: where the accelerator lacks fp16 (CPUs without AVX512-FP16) the dtype the
    engine passes (the model's) is dropped for bfloat16. NVMe parameter offload then sizes and
    writes its swap files in bfloat16: an fp32 partition under 2 MiB is never swapped (DeepSpeed
    swaps from 1 MiB) and a larger one is rounded to bfloat16 on its way to disk. DeepSpeed PR
    8428 fixes a neighbouring typo on that line, not this.
    """
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._set_dtype
    if getattr(original, "mdtk_patched", False):
        return

    @functools.wraps(original)
    def set_dtype(self, ds_config, dtype):
        original(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    set_dtype.mdtk_patched = True
    _patch(Init, "_set_dtype", set_dtype, "deepspeed zero.Init keeps an explicit dtype")


def cache_cpu_info() -> None:
    """py-cpuinfo's ``get_cpu_info`` starts a Python process at every call (about a second of
    CPU), and DeepSpeed calls it twice per op it loads and once per CPU Adam: ask once per
    process (each caller gets its own copy). Idempotent."""
    import copy

    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then asks lscpu instead
        return
    if getattr(cpuinfo.get_cpu_info, "mdtk_patched", False):
        return
    once = functools.lru_cache(maxsize=1)(cpuinfo.get_cpu_info)

    @functools.wraps(cpuinfo.get_cpu_info)
    def get_cpu_info():
        return copy.deepcopy(once())

    get_cpu_info.mdtk_patched = True
    # not in PATCHED: that lists the CPU redirects (a process without them stays one, e.g. for
    # building HF references in the test process), and this changes no answer
    cpuinfo.get_cpu_info = get_cpu_info
