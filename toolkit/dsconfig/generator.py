"""DeepSpeed config generator: choose the ZeRO stage and offload from the memory model.

Options are tried from the least communication to the most (stage 0, 1, 2, 3, then CPU offload,
then NVMe); the first one whose per-rank estimate fits the GPU with headroom (and the host RAM /
NVMe for offload) wins. Every option considered is kept with its breakdown so the CLI can say why.
The config is linted before it is handed out, for every caller (CLI, presets, trainer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from toolkit import rules
from toolkit.dsconfig import zeropp
from toolkit.dsconfig.lint import HF_ADAM_BETAS, HF_ADAM_EPS, lint
from toolkit.errors import ConfigError
from toolkit.memory import (
    CPU,
    GIB,
    NVME,
    Cluster,
    Estimate,
    ModelShape,
    TrainShape,
    ZeroOptions,
    estimate,
)
from toolkit.parallel.layout import LayoutError, ParallelLayout, ResolvedLayout

AUTO = "auto"
STAGES = ("auto", "0", "1", "2", "3")
OFFLOADS = ("auto", "none", "cpu", "nvme")
SCHEDULERS = ("WarmupDecayLR", "WarmupCosineLR")
INT_1E9 = 1_000_000_000
AIO_BLOCK = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
             "single_submit": False, "overlap_events": True}


@dataclass(frozen=True)
class Request:
    model: ModelShape
    cluster: Cluster
    train: TrainShape = field(default_factory=TrainShape)
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    stage: str = AUTO
    offload: str = AUTO
    hf_trainer: bool = False
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    gradient_clipping: float = 1.0
    scheduler: str = "WarmupDecayLR"
    warmup_steps: int = 100
    total_steps: int = 10000
    headroom: float = 0.10  # fraction of GPU / host memory kept free
    gpu_reserve: int = 2 * GIB  # CUDA context, NCCL buffers, allocator fragmentation
    # ZeRO++ (stage 3): a value forces it; None lets the planner choose (toolkit.planner.
    # zero_auto: hpZ when it pays on several nodes, qwZ/qgZ only with allow_quantized_comm)
    # and means off in ``generate``.
    hpz: int | None = None
    quantized_weights: bool | None = None
    quantized_gradients: bool | None = None
    allow_quantized_comm: bool = False

    @property
    def forced_zeropp(self) -> tuple[int, bool, bool]:
        """(hpz, qwZ, qgZ) as the request fixes them (None counts as off)."""
        return self.hpz or 1, bool(self.quantized_weights), bool(self.quantized_gradients)


@dataclass(frozen=True)
class Option:
    """One (stage, offload) candidate and what the memory model says about it. ``recompute``
    is set when the search chose it too (``toolkit.planner.zero_auto``), None when the request
    fixed it."""

    zero: ZeroOptions
    estimate: Estimate | None
    fits: bool
    reason: str
    recompute: str | None = None

    @property
    def label(self) -> str:
        z = self.zero
        text = f"ZeRO-{z.stage}"
        if z.offload_optimizer != "none":
            text += f" + optimizer->{z.offload_optimizer}"
        if z.offload_param != "none":
            text += f" + params->{z.offload_param}"
        if z.zeropp:
            text += " + ZeRO++ " + "+".join([f"hpZ {z.hpz}"] * (z.hpz > 1)
                                            + ["qwZ"] * z.quantized_weights
                                            + ["qgZ"] * z.quantized_gradients)
        if self.recompute is not None:
            text += f" + recompute {self.recompute}"
        return text


@dataclass(frozen=True)
class Plan:
    config: dict[str, Any]
    chosen: Option
    considered: tuple[Option, ...]
    notes: tuple[str, ...]


#: Smallest reduce / all-gather bucket (elements; 8 MiB in bf16). Below it every collective is
#: latency-bound: a 4M-parameter model with h*h = 65k buckets ran ~130 collectives a step and
#: spent half its step in them on gloo. Models with h >= 2048 are unaffected.
MIN_BUCKET = 2048 * 2048


@lru_cache(maxsize=256)
def largest_tensor(model: ModelShape) -> int:
    """Elements of the model's largest tensor (remembered: the planner asks once per
    candidate, and it walks every tensor)."""
    return max(t.numel for t in model.tensors())


def zero_options(model: ModelShape, stage: int, opt: str = "none", param: str = "none"
                 ) -> ZeroOptions:
    """Bucket sizes from the hidden size (h*h, 0.9*h*h, 10*h as HF's integration does; reduce
    and all-gather buckets at least ``MIN_BUCKET``), ints."""
    h = model.hidden
    largest = largest_tensor(model)
    bucket = max(h * h, MIN_BUCKET)
    return ZeroOptions(
        stage=stage, offload_optimizer=opt, offload_param=param,
        reduce_bucket_size=bucket, allgather_bucket_size=bucket,
        prefetch_bucket_size=int(0.9 * h * h), param_persistence_threshold=10 * h,
        max_live_parameters=INT_1E9,
        sub_group_size=100_000_000 if NVME in (opt, param) else INT_1E9,
        param_buffer_size=max(100_000_000, largest),
    )


def candidate_zero(model: ModelShape, stage: str, offload: str) -> list[ZeroOptions]:
    """The options to try, cheapest communication first, filtered by --stage / --offload."""
    table = [
        (0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
        (2, CPU, "none"), (3, CPU, "none"), (3, CPU, CPU),
        (3, NVME, "none"), (3, NVME, NVME),
    ]
    out = []
    for s, opt, param in table:
        if stage != AUTO and int(stage) != s:
            continue
        kind = opt if opt != "none" else "none"
        if offload != AUTO and offload != kind:
            continue
        out.append(zero_options(model, s, opt, param))
    return out


def _budget(req: Request) -> tuple[int, int]:
    gpu = int(req.cluster.gpu_mem * (1 - req.headroom)) - req.gpu_reserve
    cpu_per_rank = int(req.cluster.cpu_mem * (1 - req.headroom)) // req.cluster.gpus_per_node
    return gpu, cpu_per_rank


def zero_problem(req: Request, stage: int, layout: ResolvedLayout) -> str | None:
    """Why ZeRO ``stage`` cannot train the request at ``layout`` (``toolkit.rules``: pipeline,
    and for mdtk's trainer experts and clipping; HF Trainer runs its own models), or None."""
    if req.hf_trainer:
        return rules.zero_with_pipeline(stage, layout.pp, clipping=False)
    return rules.zero_problem(stage, pp=layout.pp, experts=bool(req.model.experts),
                              clipping=req.gradient_clipping > 0)


def evaluate(req: Request, zero: ZeroOptions, layout: ResolvedLayout) -> Option:
    """Estimate one option at the request's resolved ``layout`` and decide whether it fits,
    saying why not."""
    if (problem := zero_problem(req, zero.stage, layout)) is not None:
        return Option(zero, None, False, problem)
    if NVME in (zero.offload_optimizer, zero.offload_param) and not req.cluster.nvme_path:
        return Option(zero, None, False, "needs --nvme-path")
    try:
        est = estimate(req.model, req.train, layout, zero)
    except LayoutError as e:
        return Option(zero, None, False, str(e))
    gpu_budget, cpu_budget = _budget(req)
    if est.gpu > gpu_budget:
        act = est.activations()
        return Option(zero, est, False, f"GPU needs {_gib(est.gpu)} > budget {_gib(gpu_budget)} "
                      f"(activations {_gib(act)})")
    if est.cpu > cpu_budget:
        return Option(zero, est, False,
                      f"host needs {_gib(est.cpu)} per rank > {_gib(cpu_budget)} "
                      f"({_gib(req.cluster.cpu_mem)} per node / {req.cluster.gpus_per_node} ranks)")
    nvme_node = est.nvme * req.cluster.gpus_per_node
    if req.cluster.nvme_size is not None and nvme_node > req.cluster.nvme_size:
        return Option(zero, est, False, f"NVMe needs {_gib(nvme_node)} per node > "
                      f"{_gib(req.cluster.nvme_size)}")
    return Option(zero, est, True, f"fits: GPU {_gib(est.gpu)} of {_gib(gpu_budget)} budget")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def validate_request(req: Request) -> ResolvedLayout:
    """The request's layout, resolved once for the cluster; ConfigError for values no option can
    satisfy."""
    if req.stage not in STAGES:
        raise ConfigError(f"--stage {req.stage!r}: use one of {', '.join(STAGES)}.")
    if req.offload not in OFFLOADS:
        raise ConfigError(f"--offload {req.offload!r}: use one of {', '.join(OFFLOADS)}.")
    if req.scheduler not in SCHEDULERS:
        raise ConfigError(f"scheduler {req.scheduler!r}: use one of {', '.join(SCHEDULERS)}.")
    if req.offload == NVME and not req.cluster.nvme_path:
        raise ConfigError("--offload nvme needs --nvme-path (a folder on a local NVMe drive).")
    if req.hf_trainer and req.layout.model_parallel > 1:
        raise ConfigError(
            f"--hf-trainer with {req.layout.describe()}: HF Trainer / accelerate run plain data "
            "parallelism (its train_batch_size uses the whole world size); drop --tp/--pp/--cp "
            "or generate without --hf-trainer."
        )
    try:
        layout = req.layout.resolve(req.cluster.world_size)
    except LayoutError as e:
        raise ConfigError(str(e)) from e
    if req.stage != AUTO:  # a combination that cannot train: say so, not "nothing fits"
        problem = zero_problem(req, int(req.stage), layout)
        if problem:
            raise ConfigError(problem)
    _validate_zeropp(req, layout)
    if not candidate_zero(req.model, req.stage, req.offload):
        raise ConfigError(f"--stage {req.stage} with --offload {req.offload} leaves no option: "
                          "offload needs stage >= 2 here (optimizer) or 3 (NVMe, parameters).")
    return layout


def _validate_zeropp(req: Request, layout: ResolvedLayout) -> None:
    """ZeRO++ options the request fixes: only at stage 3 and where DeepSpeed runs them right."""
    hpz, qwz, qgz = req.forced_zeropp
    if not (hpz > 1 or qwz or qgz):
        return
    if req.stage != AUTO and (problem := rules.zeropp_stage_problem(int(req.stage))):
        raise ConfigError(f"{problem} Use --stage 3 (or auto) or drop the ZeRO++ options.")
    block = {"stage": 3, zeropp.HPZ: hpz, "zero_quantized_weights": qwz,
             "zero_quantized_gradients": qgz}
    errors, _ = zeropp.findings(block, layout, req.cluster.world_size,
                                req.cluster.gpus_per_node, comm_dtype="fp16")  # see build
    if errors:
        raise ConfigError(" ".join(errors))


def with_zeropp(zero: ZeroOptions, hpz: int = 1, qwz: bool = False, qgz: bool = False
                ) -> ZeroOptions:
    """``zero`` with these ZeRO++ options (stage 3; other stages stay as they are)."""
    if zero.stage != 3:
        return zero
    return dataclasses.replace(zero, hpz=hpz, quantized_weights=qwz, quantized_gradients=qgz)


def request_zero(req: Request) -> list[ZeroOptions]:
    """The options to try for ``req``: ``candidate_zero`` with the ZeRO++ options it fixes
    (then only stage 3)."""
    hpz, qwz, qgz = req.forced_zeropp
    out = candidate_zero(req.model, req.stage, req.offload)
    if hpz > 1 or qwz or qgz:
        out = [with_zeropp(z, hpz, qwz, qgz) for z in out if z.stage == 3]
    return out


def nothing_fits(req: Request, layout: ResolvedLayout, considered: list[Option]) -> ConfigError:
    """The error that lists every option considered with the memory model's reason."""
    lines = [f"{o.label}: {o.reason}" for o in considered]
    return ConfigError(
        f"nothing fits {req.model.name} on {req.cluster.world_size} x "
        f"{_gib(req.cluster.gpu_mem)} GPUs ({layout.describe()}, seq {req.train.seq_len}, "
        f"micro-batch {req.train.micro_batch}):\n  " + "\n  ".join(lines) + "\nTry more "
        "GPUs, tensor/pipeline parallelism (--tp/--pp), a smaller --micro-batch or "
        "--seq-len, recompute, or allow offload (--offload auto with --nvme-path)."
    )


def generate(req: Request) -> Plan:
    """Pick the option, build the config; ConfigError (with every option's numbers) otherwise.
    The request's recompute is fixed here; ``toolkit.planner.zero_auto`` chooses it too."""
    layout = validate_request(req)
    considered: list[Option] = []
    for zero in request_zero(req):
        option = evaluate(req, zero, layout)
        considered.append(option)
        if option.fits:
            break
    chosen = considered[-1]
    if not chosen.fits:
        raise nothing_fits(req, layout, considered)
    assert chosen.estimate is not None
    notes: list[str] = []
    config = build_config(req, chosen, layout, notes)
    # mdtk's own checks only: DeepSpeed's parser imports torch (estimate / ds-config stay
    # torch-free); the trainer's final lint and `ds-config --deepspeed-parse` run it.
    report = lint(config, world_size=None if req.hf_trainer else req.cluster.world_size,
                  layout=layout, run_deepspeed=False, gpus_per_node=req.cluster.gpus_per_node)
    if report.errors:  # a generator bug: never hand out a config mdtk's lint refuses
        raise RuntimeError("generated config failed the lint (a generator bug):\n  "
                           + "\n  ".join(report.errors))
    return Plan(config, chosen, tuple(considered), tuple(notes))


def build_config(req: Request, chosen: Option, layout: ResolvedLayout,
                 notes: list[str]) -> dict[str, Any]:
    """The DeepSpeed JSON for the chosen option: every key a real run needs, all ints exact."""
    est = chosen.estimate
    zero = chosen.zero
    train = req.train
    hf = req.hf_trainer
    gas = est.num_microbatches
    micro = train.micro_batch
    cfg: dict[str, Any] = {
        "train_batch_size": AUTO if hf else micro * gas * layout.dp_cp,
        "train_micro_batch_size_per_gpu": AUTO if hf else micro,
        "gradient_accumulation_steps": AUTO if hf else gas,
        "gradient_clipping": AUTO if hf else req.gradient_clipping,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if hf:
        cfg["bf16"] = {"enabled": AUTO}
        cfg["fp16"] = {"enabled": AUTO}
    elif train.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif train.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
                       "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1}
    cfg["zero_optimization"] = _zero_block(req, zero, est, notes)
    if cfg["zero_optimization"].get("zero_quantized_gradients"):
        cfg["communication_data_type"] = "fp16"
        notes.append('qgZ: "communication_data_type": "fp16" (DeepSpeed\'s int4 gradient '
                     "kernel reads its input as fp16; bf16 or fp32 gradients would be noise).")
    if NVME in (zero.offload_optimizer, zero.offload_param):
        cfg["aio"] = dict(AIO_BLOCK)
    # "auto" only where both the HF Trainer and accelerate fill it (lint.HF_ONLY_AUTO_KEYS)
    cfg["optimizer"] = {"type": "AdamW", "params": {
        "lr": AUTO if hf else req.lr,
        "betas": list(HF_ADAM_BETAS if hf else req.betas),
        "eps": HF_ADAM_EPS if hf else req.eps,
        "weight_decay": AUTO if hf else req.weight_decay,
    }}
    if zero.offload_optimizer != "none":
        notes.append("optimizer offload: DeepSpeed runs the AdamW step with its CPU Adam "
                     "(DeepSpeedCPUAdam); a client torch optimizer would be rejected.")
    cfg["scheduler"] = _scheduler(req)
    return cfg


def _zero_block(req: Request, zero: ZeroOptions, est: Estimate, notes: list[str]
                ) -> dict[str, Any]:
    hf = req.hf_trainer
    block: dict[str, Any] = {"stage": zero.stage}
    if zero.stage == 0:
        return block
    block.update(
        overlap_comm=True, contiguous_gradients=True, reduce_scatter=True,
        reduce_bucket_size=AUTO if hf else zero.reduce_bucket_size,
    )
    if zero.stage in (1, 2):
        block["allgather_partitions"] = True
        block["allgather_bucket_size"] = zero.allgather_bucket_size
    else:
        block.update(
            stage3_prefetch_bucket_size=AUTO if hf else zero.prefetch_bucket_size,
            stage3_param_persistence_threshold=AUTO if hf else zero.param_persistence_threshold,
            stage3_max_live_parameters=zero.max_live_parameters,
            stage3_max_reuse_distance=INT_1E9,
            stage3_gather_16bit_weights_on_model_save=True,
        )
        if zero.hpz > 1:
            block[zeropp.HPZ] = zero.hpz
        if zero.quantized_weights:
            block["zero_quantized_weights"] = True
        if zero.quantized_gradients:
            block["zero_quantized_gradients"] = True
    block["sub_group_size"] = zero.sub_group_size
    pinned_per_node = est.cpu * req.cluster.gpus_per_node
    pin = pinned_per_node <= req.cluster.cpu_mem // 2
    if zero.offload_optimizer != "none" or zero.offload_param != "none":
        notes.append(
            f"pin_memory={str(pin).lower()}: offload pins {_gib(pinned_per_node)} per node of "
            f"{_gib(req.cluster.cpu_mem)} host RAM (pinned only when it is at most half, since "
            "pinned pages cannot be swapped out)."
        )
    if zero.offload_optimizer != "none":
        off: dict[str, Any] = {"device": zero.offload_optimizer, "pin_memory": pin}
        if zero.offload_optimizer == NVME:
            off.update(nvme_path=req.cluster.nvme_path, buffer_count=zero.optimizer_buffer_count,
                       fast_init=False)
        block["offload_optimizer"] = off
    if zero.offload_param != "none":
        offp: dict[str, Any] = {"device": zero.offload_param, "pin_memory": pin}
        if zero.offload_param == NVME:
            offp.update(nvme_path=req.cluster.nvme_path, buffer_count=zero.param_buffer_count,
                        buffer_size=zero.param_buffer_size, max_in_cpu=INT_1E9)
        block["offload_param"] = offp
    return block


def _scheduler(req: Request) -> dict[str, Any]:
    hf = req.hf_trainer
    if req.warmup_steps < 1 or req.total_steps <= req.warmup_steps:
        raise ConfigError(f"warmup_steps={req.warmup_steps} and total_steps={req.total_steps}: "
                          "need 1 <= warmup_steps < total_steps.")
    if req.scheduler == "WarmupCosineLR":
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": AUTO if hf else req.total_steps,
            "warmup_num_steps": AUTO if hf else req.warmup_steps,
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1,
        }}
    return {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": AUTO if hf else 0.0,
        "warmup_max_lr": AUTO if hf else req.lr,
        "warmup_num_steps": AUTO if hf else req.warmup_steps,
        "total_num_steps": AUTO if hf else req.total_steps,
    }}
