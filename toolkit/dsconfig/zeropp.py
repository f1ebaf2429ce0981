"""What DeepSpeed 0.19's ZeRO++ options (hpZ, qwZ, qgZ) need, and what became of MiCS, as the
sentences the lint and the generator say (one home for both; docs/memory-model.md, "ZeRO++").

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

from toolkit.parallel.layout import ParallelLayout

HPZ = "zero_hpz_partition_size"
QUANTIZED = ("zero_quantized_weights", "zero_quantized_gradients",
             "zero_quantized_nontrainable_weights")
KEYS = (HPZ, *QUANTIZED)
MICS = ("mics_shard_size", "mics_hierarchical_params_gather")
MIXED_GROUPS = (
    "DeepSpeed 0.19 builds {what} from consecutive world ranks, not from the data-parallel "
    "group, so with {layout} they mix ranks that hold different weights and the run trains "
    "silently wrong{measured}. Use it only with tp = pp = 1.")
#: What mdtk measured when hpZ ran with tensor parallelism (docs/memory-model.md, "ZeRO++").
MEASURED = " (measured: hpZ 2 at tp2 x dp2 starts 2.9% above the right loss)"


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
    """(errors, warnings) of a ``zero_optimization`` block's ZeRO++ and MiCS keys. The world
    size, the GPUs per node and the gradients' communication dtype (``communication_dtype``)
    are checked against when known."""
    errors: list[str] = []
    warnings: list[str] = []
    stage = zero.get("stage", 0)
    hpz, quantized = hpz_of(zero), quantized_of(zero)
    _mics(zero, hpz, errors)
    if isinstance(stage, int) and stage < 3:
        for key in ([HPZ] if hpz > 1 else []) + quantized:
            errors.append(f"zero_optimization.{key} at stage {stage} does nothing: only ZeRO-3 "
                          "reads it (DeepSpeed accepts it silently). Set stage 3 or remove it.")
        return errors, warnings
    if layout.tp * layout.pp > 1:
        where = f"tp={layout.tp} pp={layout.pp}"
        if hpz > 1:
            errors.append(f"zero_optimization.{HPZ}={hpz} with {where}: " + MIXED_GROUPS.format(
                what="the hpZ groups", layout=where, measured=MEASURED))
        if "zero_quantized_gradients" in quantized:
            errors.append(f"zero_optimization.zero_quantized_gradients with {where}: "
                          + MIXED_GROUPS.format(what="qgZ's all-to-all groups", layout=where,
                                                measured=""))
    if "zero_quantized_gradients" in quantized and comm_dtype not in (None, "fp16"):
        errors.append(
            f"zero_optimization.zero_quantized_gradients with {comm_dtype} gradient "
            "communication: DeepSpeed 0.19's qgZ kernel reads the gradients as fp16 whatever "
            f"their dtype, so {comm_dtype} gradients are reduced as noise (measured: relative "
            'error 1.06 with bf16 input). Set "communication_data_type": "fp16" (gradients are '
            "cast to fp16 for the reduction and back) or turn qgZ off.")
    if hpz > 1:
        _hpz_size(hpz, layout, world_size, gpus_per_node, errors, warnings)
    if "zero_quantized_gradients" in quantized and world_size and gpus_per_node and \
            world_size <= gpus_per_node:
        warnings.append("zero_optimization.zero_quantized_gradients on one node does nothing: "
                        "DeepSpeed uses its int4 all-to-all only when the world spans nodes.")
    return errors, warnings


def _mics(zero: dict[str, Any], hpz: int, errors: list[str]) -> None:
    keys = [k for k in MICS if k in zero]
    if not keys:
        return
    if hpz > 1:
        errors.append(f"zero_optimization.{keys[0]} with {HPZ}={hpz}: MiCS and hpZ do not "
                      "combine (both re-partition the parameters), and DeepSpeed 0.19 removed "
                      "MiCS altogether. Keep zero_hpz_partition_size and drop the mics_* keys.")
        return
    errors.append(f"zero_optimization.{keys[0]}: MiCS was removed from DeepSpeed (0.19 rejects "
                  "the key). For its intra-node parameter gathers use ZeRO++'s hpZ: "
                  f"{HPZ} = the GPUs per node, at stage 3.")


def _hpz_size(hpz: int, layout: ParallelLayout, world_size: int | None,
              gpus_per_node: int | None, errors: list[str], warnings: list[str]) -> None:
    dp = None
    if world_size is not None and world_size % layout.model_parallel == 0:
        dp = world_size // layout.model_parallel * layout.cp
    if dp is not None and dp % hpz:
        errors.append(f"zero_optimization.{HPZ}={hpz} does not divide the data-parallel size "
                      f"{dp} (DeepSpeed asserts it divides the world): use a divisor of {dp}, "
                      "normally the GPUs per node.")
    if gpus_per_node is not None and hpz > gpus_per_node:
        errors.append(f"zero_optimization.{HPZ}={hpz} is larger than the {gpus_per_node} GPUs "
                      "of a node: the secondary partition's group then spans nodes, so the "
                      "gathers hpZ should keep on the node cross the network. Set it to "
                      f"{gpus_per_node}.")
    elif gpus_per_node is not None and gpus_per_node % hpz:
        warnings.append(f"zero_optimization.{HPZ}={hpz} does not divide the {gpus_per_node} "
                        "GPUs per node: some hpZ groups straddle two nodes.")
    if dp is not None and hpz >= dp:
        warnings.append(f"zero_optimization.{HPZ}={hpz} covers the whole data-parallel group "
                        f"({dp}): the secondary partition repeats the primary one (1/{hpz} of "
                        "the parameters more memory, no traffic saved).")
