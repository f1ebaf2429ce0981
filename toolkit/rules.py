"""What trains with what: the compatibility rules of a run's setup, each stated once with its
reason, for every place that applies them (the trainer's checks and its engine, the DeepSpeed
config lint and generator, the memory model, the planner), so they cannot disagree.

A rule is a pure function of plain values (stage, pipeline stages, experts, clipping, offload
devices, ZeRO++ options) that returns the reason a combination cannot work, or None. The caller
adds what names its own input (a YAML key, a JSON path, a command-line flag) and raises its own
error class. No torch, no other toolkit module: the bottom layer, so every layer can ask.

Two levels for ZeRO with pipeline parallelism (docs/training.md, "What is refused"): mdtk's
engine (megatron-core schedules in a DeepSpeed engine, reduction coalesced over the schedule)
runs ZeRO-1 and ZeRO-2 with pp > 1; mdtk's configs (generator, lint, memory model, planner and so
the trainer) leave out ZeRO-2 with pp > 1 as DeepSpeed's own pipeline engine does, since stage 1
holds the same memory in DeepSpeed 0.19. ``configs=False`` asks for the engine's level alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# -- activation recompute ----------------------------------------------------------------------

Recompute = Literal["none", "selective", "full"]
#: The recompute choices of the trainer (``train.recompute``), the memory model and the planner.
RECOMPUTE: tuple[Recompute, ...] = get_args(Recompute)
#: What HF Trainer can do (``gradient_checkpointing``): no selective mode.
HF_RECOMPUTE: tuple[Recompute, ...] = ("none", "full")


def recompute_problem(value: object) -> str | None:
    if value in RECOMPUTE:
        return None
    return f"recompute={value!r}: use one of {', '.join(RECOMPUTE)}."


# -- ZeRO stage x pipeline x experts x clipping x precision -----------------------------------

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Setup:
    """What the training rules read of a run: its ZeRO stage, pipeline stages, whether the model
    has experts, whether gradients are clipped (DeepSpeed's default ``gradient_clipping`` is
    1.0), the precision, an fp32 gradient-accumulation dtype and optimizer offload."""

    stage: int
    pp: int = 1
    experts: bool = False
    clipping: bool = True
    precision: str = "fp32"  # bf16 | fp16 | fp32
    grad_accum_fp32: bool = False
    optimizer_offload: bool = False


def zero_stage_problem(stage: object) -> str | None:
    if stage in ZERO_STAGES and not isinstance(stage, bool):
        return None
    return f"zero_optimization.stage={stage}: choose 0, 1, 2 or 3."


def _zero0_clipping(what: str) -> str:
    return ("ZeRO stage 0 with gradient clipping and " + what + " is not supported because "
            "DeepSpeed's ZeRO-0 clipping norm counts non-tensor-parallel weights on rank 0 of "
            "the tp x pp group only (dropping later pipeline stages) and averages expert norms "
            "instead of summing them. Use zero_stage 1 (same memory for weights, sharded "
            "optimizer states) or gradient_clipping: 0.")


def zero_with_pipeline(stage: int, pp: int, *, clipping: bool = True,
                       configs: bool = True) -> str | None:
    """Why ZeRO ``stage`` cannot train with ``pp`` pipeline stages, or None. ``clipping``:
    gradients are clipped (False: the rule for a setup whose clipping is not known, such as the
    memory model's). ``configs``: mdtk's configs' level (ZeRO-2 left out too); False: what the
    engine itself can run."""
    if pp <= 1:
        return None
    if stage == 0 and clipping:
        return _zero0_clipping("pp>1")
    if stage == 3:
        fits = [str(s) for s in (1, 2) if zero_with_pipeline(s, pp, configs=configs) is None]
        what = "they partition" if len(fits) > 1 else "it partitions"
        return ("ZeRO stage 3 with pp>1 is not supported because DeepSpeed's ZeRO-3 assumes "
                "every rank runs the same modules: its parameter coordinator checks the module "
                "trace with collectives over the whole world at the start of each forward "
                "(pipeline stages hold different modules and run forwards at different times, "
                "so the ranks deadlock), it computes the grad norm over a different number of "
                "parameter sub-groups per stage, and it counts the tied embedding of the first "
                f"and last stage twice. Use zero_stage {' or '.join(fits)} with pp>1 ({what} "
                "optimizer states and gradients over the data-parallel group), or pp=1 for "
                "ZeRO-3.")
    if stage == 2 and configs:
        return (f"ZeRO stage 2 with pp={pp}: DeepSpeed cannot combine ZeRO-2/3 with pipeline "
                "parallelism (its pipeline engine refuses ZeRO-2, which reduces gradients at "
                "every micro-batch; mdtk's configs and memory model follow it). Use zero_stage 1 "
                "with pp>1 (in DeepSpeed 0.19 it holds the same memory as stage 2), or pp=1.")
    return None


def zero_with_experts(stage: int, *, clipping: bool = True) -> str | None:
    """Why ZeRO ``stage`` cannot train megatron-core experts (ep / MoE), or None."""
    if stage == 3:
        return ("ZeRO stage 3 with megatron-core experts (ep/MoE) is not supported: DeepSpeed's "
                "ZeRO-3 partitions expert parameters through its own MoE modules only. Use "
                "zero_stage 1 or 2 for MoE models.")
    if stage == 0 and clipping:
        return _zero0_clipping("experts")
    return None


def precision_problem(setup: Setup) -> str | None:
    """Why the setup's precision cannot train in mdtk's engine, or None."""
    if setup.precision == "fp16":
        return ("fp16 is not supported by the training engine: DeepSpeed's loss scaling happens "
                "in engine.backward, which megatron-core's schedules bypass. Use bf16 (or fp32).")
    if (setup.precision == "bf16" and setup.stage == 1 and setup.grad_accum_fp32
            and not setup.optimizer_offload):
        return ("bf16 with zero_stage 1 and data_types.grad_accum_dtype=fp32 selects DeepSpeed's "
                "BF16_Optimizer, which accumulates gradients in engine.backward (bypassed by "
                "megatron-core's schedules). Drop grad_accum_dtype or use zero_stage 2.")
    return None


def zero_problem(stage: int, *, pp: int = 1, experts: bool = False, clipping: bool = True,
                 configs: bool = True) -> str | None:
    """The first reason ZeRO ``stage`` cannot train with ``pp`` pipeline stages, experts and
    clipping, or None (``configs``: see ``zero_with_pipeline``)."""
    if (problem := zero_stage_problem(stage)) is not None:
        return problem
    if experts and stage == 3:
        return zero_with_experts(3)
    if stage == 0 and clipping and (pp > 1 or experts):
        return zero_with_pipeline(0, pp) or zero_with_experts(0)
    return zero_with_pipeline(stage, pp, clipping=clipping, configs=configs)


def training_problem(setup: Setup, *, configs: bool = True) -> str | None:
    """The first reason the setup cannot train in mdtk's engine, or None."""
    return zero_problem(setup.stage, pp=setup.pp, experts=setup.experts,
                        clipping=setup.clipping, configs=configs) or precision_problem(setup)


def zero_allowed(stage: int, pp: int, experts: bool) -> bool:
    """Whether mdtk's configs train ZeRO ``stage`` at ``pp`` with clipping on (the planner's
    question)."""
    return zero_problem(stage, pp=pp, experts=experts) is None


# -- ZeRO x offload ----------------------------------------------------------------------------

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def offload_problems(stage: int, optimizer: str = "none", param: str = "none"
                     ) -> list[tuple[str, str]]:
    """Why offloading the optimizer states to ``optimizer`` and the parameters to ``param``
    (none / cpu / nvme) does not work at ZeRO ``stage``: (``offload_optimizer`` or
    ``offload_param``, the reason in DeepSpeed's words of what it then does) each. The caller
    names its keys before and says the fix after."""
    out = []
    if param != "none" and stage != 3:
        out.append(("offload_param", "parameter offload needs ZeRO stage 3 (DeepSpeed ignores "
                    f"it silently at stage {stage})."))
    if optimizer == "nvme" and stage in (1, 2):
        out.append(("offload_optimizer", "optimizer offload to NVMe needs ZeRO stage 3: at "
                    "stage 1 or 2 DeepSpeed silently runs it as CPU offload (NVMe swapping is "
                    "stage 3 only)."))
    if optimizer != "none" and stage == 0:
        out.append(("offload_optimizer", "optimizer offload needs ZeRO stage >= 1 (it does "
                    "nothing at stage 0)."))
    return out


# -- ZeRO++ (hpZ, qwZ, qgZ) and MiCS: what DeepSpeed 0.19 needs (docs/memory-model.md) ---------

HPZ = "zero_hpz_partition_size"
#: What mdtk measured when hpZ ran with tensor parallelism (docs/memory-model.md, "ZeRO++").
MEASURED = " (measured: hpZ 2 at tp2 x dp2 starts 2.9% above the right loss)"


def zeropp_stage_problem(stage: int, what: str = "ZeRO++ (hpZ, qwZ, qgZ)") -> str | None:
    """Why ZeRO++ option(s) ``what`` do nothing at ``stage``, or None (stage 3)."""
    if stage == 3:
        return None
    return (f"{what} at stage {stage} does nothing: only ZeRO-3 uses it, so it needs ZeRO stage "
            "3 (DeepSpeed accepts it silently at stages 0-2).")


def zeropp_groups_problem(tp: int, pp: int, what: str = "the hpZ and qgZ groups",
                          measured: str = "") -> str | None:
    """Why ZeRO++'s hpZ and qgZ (``what``) cannot run with tp / pp > 1, or None: DeepSpeed
    builds their groups from world ranks."""
    if tp * pp == 1:
        return None
    return (f"DeepSpeed 0.19 builds {what} from consecutive world ranks, not from the "
            f"data-parallel group, so with tp={tp} pp={pp} they mix ranks that hold different "
            f"weights and the run trains silently wrong{measured}. Use it only with tp = pp = 1.")


def zeropp_group_problems(tp: int, pp: int, *, hpz: int = 1, qgz: bool = False) -> list[str]:
    """``zeropp_groups_problem`` for each of hpZ (``hpz`` > 1) and qgZ that is on, under its
    DeepSpeed key."""
    where = f"with tp={tp} pp={pp}: "
    out = []
    if hpz > 1 and (p := zeropp_groups_problem(tp, pp, "the hpZ groups", MEASURED)):
        out.append(f"zero_optimization.{HPZ}={hpz} {where}{p}")
    if qgz and (p := zeropp_groups_problem(tp, pp, "qgZ's all-to-all groups")):
        out.append(f"zero_optimization.zero_quantized_gradients {where}{p}")
    return out


def qgz_dtype_problem(comm_dtype: str | None) -> str | None:
    """Why qgZ cannot reduce gradients communicated in ``comm_dtype``, or None (fp16, or not
    known)."""
    if comm_dtype in (None, "fp16"):
        return None
    return (f"zero_optimization.zero_quantized_gradients with {comm_dtype} gradient "
            "communication: DeepSpeed 0.19's qgZ kernel reads the gradients as fp16 whatever "
            f"their dtype, so {comm_dtype} gradients are reduced as noise (measured: relative "
            'error 1.06 with bf16 input). Set "communication_data_type": "fp16" (gradients are '
            "cast to fp16 for the reduction and back) or turn qgZ off.")


def hpz_size_problems(hpz: int, dp: int | None, gpus_per_node: int | None) -> list[str]:
    """Why an hpZ partition of ``hpz`` ranks does not fit a data-parallel group of ``dp`` ranks
    (DeepSpeed asserts it divides) or nodes of ``gpus_per_node`` GPUs (where known)."""
    out = []
    if dp is not None and dp % hpz:
        out.append(f"zero_optimization.{HPZ}={hpz} does not divide the data-parallel size {dp} "
                   "(DeepSpeed asserts it divides the world): use a divisor of "
                   f"{dp}, normally the GPUs per node.")
    if gpus_per_node is not None and hpz > gpus_per_node:
        out.append(f"zero_optimization.{HPZ}={hpz} is larger than the {gpus_per_node} GPUs of a "
                   "node: the secondary partition's group then spans nodes, so the gathers hpZ "
                   f"should keep on the node cross the network. Set it to {gpus_per_node}.")
    return out


def mics_problem(key: str, hpz: int) -> str:
    """The reason a MiCS key (``mics_shard_size``, ...) cannot be used: DeepSpeed removed it."""
    if hpz > 1:
        return (f"zero_optimization.{key} with {HPZ}={hpz}: MiCS and hpZ do not combine (both "
                "re-partition the parameters), and DeepSpeed 0.19 removed MiCS altogether. Keep "
                "zero_hpz_partition_size and drop the mics_* keys.")
    return (f"zero_optimization.{key}: MiCS was removed from DeepSpeed (0.19 rejects the key). "
            f"For its intra-node parameter gathers use ZeRO++'s hpZ: {HPZ} = the GPUs per node, "
            "at stage 3.")


# -- context parallelism ----------------------------------------------------------------------

def cp_attention_problem(window_size: object = None, softmax_type: str = "vanilla") -> str | None:
    """What mdtk's context-parallel attention (``toolkit.models.cp_attention``: all-gathered
    K/V, exact causal blocks) cannot compute, from megatron-core's attention settings: asked by
    the attention itself and, before any model is built, by ``Family.cp_refusal``."""
    if window_size is not None:
        return "mdtk's context-parallel attention has no sliding-window attention"
    if softmax_type != "vanilla":
        return f"mdtk's context-parallel attention has no softmax_type={softmax_type}"
    return None
