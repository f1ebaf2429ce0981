"""What DeepSpeed 0.19's ZeRO++ options (hpZ, qwZ, qgZ) need, and what became of MiCS, read from
a ``zero_optimization`` block for the lint and the generator: the errors are the rules of
``toolkit.rules`` (each sentence once), the warnings are said here (docs/memory-model.md,
"ZeRO++").

Facts from DeepSpeed 0.19.8's code, checked on real engines (tests/test_zeropp.py):
- Only ZeRO-3 reads the keys (``stage3.py``, ``partition_parameters.py``); stages 1 and 2 accept
  them and do nothing.
- hpZ's groups are blocks of ``zero_hpz_partition_size`` consecutive *world* ranks
  (``utils/groups.py: _create_zero_param_parallel_group``, which asserts that the size divides
  the world), and qgZ's all-to-all groups are built from world ranks too
  (``_get_local_all_to_all_group``): neither follows the mpu's data-parallel group, so with
  tensor or pipeline parallelism they mix ranks that hold different weights.
- qwZ and qgZ run DeepSpeed's ``QuantizerBuilder`` kernels (CUDA); on the CPU accelerator it is
  not implemented.
- MiCS (``mics_shard_size``, ``mics_hierarchical_params_gather``) was removed: ``DeepSpeedConfig``
  raises for those keys.
- qgZ's first kernel (``swizzle_quant`` in ``csrc/quantization/pt_binding.cpp``) casts its input's
  pointer to ``__half*`` whatever the tensor's dtype, and ZeRO-3 hands it the gradients in the
  communication dtype (the training dtype unless ``communication_data_type`` says otherwise):
  bf16 or fp32 gradients are read as fp16 bit patterns (scripts/bench_zeropp.py on an H200:
  relative error 1.06 for bf16 input, i.e. noise). Only fp16 communication gives a real int4
  reduction.
"""

from __future__ import annotations

from typing import Any

from toolkit import rules
from toolkit.parallel.layout import ParallelLayout, ResolvedLayout

HPZ = rules.HPZ
QUANTIZED = ("zero_quantized_weights", "zero_quantized_gradients",
             "zero_quantized_nontrainable_weights")
KEYS = (HPZ, *QUANTIZED)
MICS = ("mics_shard_size", "mics_hierarchical_params_gather")


def hpz_of(zero: dict[str, Any]) -> int:
    value = zero.get(HPZ, 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def quantized_of(zero: dict[str, Any]) -> list[str]:
    """The quantized-communication keys switched on."""
    return [k for k in QUANTIZED if zero.get(k) is True]


def communication_dtype(cfg: dict[str, Any]) -> str:
    """The dtype DeepSpeed reduces gradients in: ``communication_data_type``, else the training
    dtype (``engine.communication_data_type``)."""
    named = cfg.get("communication_data_type")
    if isinstance(named, str):
        return {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16",
                "bfloat16": "bf16"}.get(named.lower(), "fp32")
    for key in ("fp16", "bf16"):
        block = cfg.get(key)
        if isinstance(block, dict) and block.get("enabled") is True:
            return key
    return "fp32"


def findings(zero: dict[str, Any], layout: ParallelLayout, world_size: int | None = None,
             gpus_per_node: int | None = None, comm_dtype: str | None = None
             ) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a ``zero_optimization`` block's ZeRO++ and MiCS keys: the rules of
    ``toolkit.rules`` (errors) and what is probably unintended (warnings). The world size (with
    a ``ResolvedLayout``: its data-parallel size), the GPUs per node and the gradients'
    communication dtype (``communication_dtype``) are checked against when known."""
    errors: list[str] = []
    warnings: list[str] = []
    stage = zero.get("stage", 0)
    hpz, quantized = hpz_of(zero), quantized_of(zero)
    mics = [k for k in MICS if k in zero]
    if mics:
        errors.append(rules.mics_problem(mics[0], hpz))
    if isinstance(stage, int) and stage < 3:
        for key in ([HPZ] if hpz > 1 else []) + quantized:
            errors.append(f"{rules.zeropp_stage_problem(stage, f'zero_optimization.{key}')} "
                          "Set stage 3 or remove it.")
        return errors, warnings
    qgz = "zero_quantized_gradients" in quantized
    errors += rules.zeropp_group_problems(layout.tp, layout.pp, hpz=hpz, qgz=qgz)
    if qgz and (problem := rules.qgz_dtype_problem(comm_dtype)):
        errors.append(problem)
    if hpz > 1:
        dp = layout.dp_cp if isinstance(layout, ResolvedLayout) else None
        errors += rules.hpz_size_problems(hpz, dp, gpus_per_node)
        warnings += _hpz_warnings(hpz, dp, gpus_per_node)
    if qgz and world_size and gpus_per_node and world_size <= gpus_per_node:
        warnings.append("zero_optimization.zero_quantized_gradients on one node does nothing: "
                        "DeepSpeed uses its int4 all-to-all only when the world spans nodes.")
    return errors, warnings


def _hpz_warnings(hpz: int, dp: int | None, gpus_per_node: int | None) -> list[str]:
    out = []
    if gpus_per_node is not None and hpz <= gpus_per_node and gpus_per_node % hpz:
        out.append(f"zero_optimization.{HPZ}={hpz} does not divide the {gpus_per_node} GPUs "
                   "per node: some hpZ groups straddle two nodes.")
    if dp is not None and hpz >= dp:
        out.append(f"zero_optimization.{HPZ}={hpz} covers the whole data-parallel group "
                   f"({dp}): the secondary partition repeats the primary one (1/{hpz} of the "
                   "parameters more memory, no traffic saved).")
    return out
