"""The training loop: config -> layout -> model (adapters) -> DeepSpeed engine -> steps.

Every rank runs ``run(cfg)`` (launched by torchrun, the deepspeed launcher or srun). The pieces
live in their own modules; this one only wires them in order:
config.plan (layout, batches) -> parallel.initialize -> data.prepare_data_distributed ->
DeepSpeed config (dsconfig.training: generated or the user's JSON, linted) ->
adapters.live.load_hf / build_model -> engine.build_engine -> resume -> train_step loop
(metrics, engine.evaluate, checkpoints) -> HF export. The phases hand each other one ``RunState``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from toolkit import parallel, runtime
from toolkit.atomic import write_text
from toolkit.parallel import LayoutError
from toolkit.train import config as cfgmod
from toolkit.train import reshard
from toolkit.train.checkpointing import (
    ENGINE_TAG,
    CheckpointManager,
    ResumeError,
    TrainingState,
    check_resume,
    load_rng,
    load_training_state,
)
from toolkit.train.config import ConfigError, TrainConfig
from toolkit.train.data import (
    DataSettings,
    GlobalBatchSampler,
    PreparedData,
    eval_micro_batches,
    prepare_data_distributed,
    step_batches,
)
from toolkit.train.engine import (
    EngineError,
    build_engine,
    check_supported,
    evaluate,
    mask_vocab_padding,
    train_step,
)
from toolkit.train.metrics import (
    MetricsWriter,
    StepMetrics,
    device_name,
    gather_memory,
    model_flops_per_token,
    peak_tflops,
    throughput,
)
from toolkit.train.schedule import LRSchedule

if TYPE_CHECKING:
    from toolkit.dsconfig.generator import Request
    from toolkit.train.faults import Heartbeat, StopGuard

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1},
}


@dataclass
class TrainResult:
    """What a run did, identical on every rank (export_dir only where it was written)."""

    steps: int
    start_step: int
    losses: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    export_dir: str | None = None
    export_max_abs_diff: float | None = None  # HF export vs the trained model's logits
    ds_config: dict[str, Any] = field(default_factory=dict)
    ds_notes: list[str] = field(default_factory=list)


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[mdtk train] {msg}", flush=True)


# -- model ---------------------------------------------------------------------------------------

def _hf_config_dict(cfg: TrainConfig) -> dict[str, Any]:
    path = Path(cfg.model.path or cfg.model.config)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"model: {file} not found (model.path must be an HF folder, "
                          "model.config an HF config.json).")
    return json.loads(file.read_text())


def _model_overrides(cfg: TrainConfig) -> dict[str, Any]:
    return dict(_RECOMPUTE[cfg.train.recompute])


def build_model(cfg: TrainConfig, layout: parallel.ParallelLayout):
    """Fine-tune: this rank's slices of the HF checkpoint. Pretrain: this rank's slices of
    weights drawn per tensor from (seed, name), identical at every layout (``train.init``)."""
    from toolkit.adapters import adapter_for, live
    from toolkit.train.init import initialize

    dtype = _DTYPES[cfg.train.precision]
    overrides = _model_overrides(cfg)
    if cfg.model.path:
        return live.load_hf(cfg.model.path, layout, dtype=dtype, **overrides)
    from transformers import AutoConfig

    raw = _hf_config_dict(cfg)
    hf = AutoConfig.for_model(**raw)
    adapter = adapter_for(hf, dtype=dtype)
    adapter.validate(layout)
    chunks = live.build_model(adapter, layout, **overrides)
    initialize(chunks, adapter, cfg.train.seed)  # the same weights at every layout
    return chunks, adapter


def _has_experts(hf_config: dict[str, Any]) -> bool:
    """Whether the model routes over experts, as its family describes it (one description)."""
    from toolkit.memory.model import model_shape_from_hf

    return model_shape_from_hf(hf_config).experts > 0


# -- DeepSpeed config ----------------------------------------------------------------------------

def _device_memory() -> tuple[int, int]:
    """(memory of one device, host RAM of this node) in bytes."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if runtime.use_cuda():
        return torch.cuda.get_device_properties(0).total_memory, host
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return host // max(local, 1), host  # CPU ranks share the host's RAM


def deepspeed_config(cfg: TrainConfig, run: cfgmod.RunPlan, hf_config: dict[str, Any],
                     total_steps: int) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed JSON for this run and the reasons it was chosen, from the dsconfig package.

    ``deepspeed.config: auto`` asks the generator (memory model; stage/offload as configured or
    chosen); a path is the user's JSON. Either way the trainer's keys (batch split, clipping,
    optimizer, precision) are set and the result is linted (``toolkit.dsconfig.training``).
    """
    from toolkit.dsconfig.training import TrainerKeys, trainer_config

    ds = cfg.deepspeed
    if ds.zero_stage != "auto":  # refuse what the engine cannot run before sizing anything
        check_supported({"zero_optimization": {"stage": int(ds.zero_stage)},
                         "fp16": {"enabled": cfg.train.precision == "fp16"},
                         "gradient_clipping": cfg.optim.clip_grad},
                        pp=run.layout.pp, has_experts=_has_experts(hf_config))
    o = cfg.optim
    keys = TrainerKeys(micro_batch=run.micro_batch, global_batch=run.global_batch,
                       grad_accum=run.grad_accum, clip_grad=o.clip_grad, lr=o.lr,
                       weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                       precision=cfg.train.precision)
    user = ds.config and ds.config != "auto"
    source = ds.config if user else _generator_request(cfg, run, hf_config, total_steps)
    try:
        return trainer_config(source, keys, run.layout)
    except ValueError as e:  # dsconfig's ConfigError, or a file that is not a JSON object
        where = f"deepspeed.config={ds.config}" if user else "deepspeed"
        raise ConfigError(f"{where}: {e}") from e


def _generator_request(cfg: TrainConfig, run: cfgmod.RunPlan, hf_config: dict[str, Any],
                       total_steps: int) -> Request:
    """What the generator needs to choose: the model, this machine's memory, the run's shape."""
    from toolkit.dsconfig.generator import Request
    from toolkit.memory import Cluster, TrainShape
    from toolkit.memory.model import model_shape_from_hf

    ds, world = cfg.deepspeed, run.layout.world_size
    gpu_mem, host = _device_memory()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cluster = Cluster(nodes=max(world // local, 1), gpus_per_node=min(local, world),
                      gpu_mem=gpu_mem, cpu_mem=host, nvme_path=ds.nvme_path)
    warmup = max(cfg.optim.warmup_steps, 1)
    return Request(
        model=model_shape_from_hf(hf_config), cluster=cluster,
        train=TrainShape(seq_len=cfg.train.seq_len, micro_batch=run.micro_batch,
                         global_batch=run.global_batch, dtype=cfg.train.precision,
                         recompute=cfg.train.recompute),
        layout=run.layout, stage=str(ds.zero_stage), offload=ds.offload, lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay, betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps, gradient_clipping=cfg.optim.clip_grad,
        warmup_steps=warmup, total_steps=max(total_steps, warmup + 1),
    )


# -- the run ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunState:
    """What the phases of one run hand each other once ``_prepare`` has built it (each rank
    holds its own model chunks and data-parallel share); the DeepSpeed engine goes alongside."""

    cfg: TrainConfig
    plan: cfgmod.RunPlan
    hf_config: dict[str, Any]
    data: PreparedData
    sampler: GlobalBatchSampler  # this rank's share of every global batch
    chunks: list[torch.nn.Module]
    adapter: Any
    ds_config: dict[str, Any]
    ds_notes: list[str]
    total_steps: int

    @property
    def checkpoints(self) -> CheckpointManager:
        return CheckpointManager(self.cfg.checkpoint_dir, self.cfg.checkpoint.keep_last)


def run(cfg: TrainConfig) -> TrainResult:
    """Train as ``cfg`` says on the ranks of the current launch (collective: every rank).

    Every refusal (layout, DeepSpeed config, resume) is a ``ConfigError`` raised before the
    engine starts. The process groups and the engine are torn down on the way out, also after an
    error, so ``run`` can be called again in the same process (tests, sweeps).
    """
    runtime.enable_cpu_mode()
    runtime.init_distributed()
    engine = None
    try:
        mpu, run_plan, hf_config = _setup(cfg)
        state = _prepare(cfg, mpu, run_plan, hf_config)
        engine = build_engine(state.chunks, mpu, state.ds_config)
        return _train(state, engine)
    except (LayoutError, EngineError, ResumeError) as e:
        raise ConfigError(str(e)) from e
    finally:
        if engine is not None:
            engine.destroy()
        parallel.destroy()


def _setup(cfg: TrainConfig) -> tuple[Any, cfgmod.RunPlan, dict[str, Any]]:
    """Layout checks that need no model, then megatron-core's process groups."""
    world, rank = dist.get_world_size(), dist.get_rank()
    with runtime.failing_together():  # e.g. a model folder missing on one node only
        run_plan = cfgmod.plan(cfg, world)
        layout = run_plan.layout
        parallel.check_supported(layout)  # before any group
        layout.validate_seq_len(cfg.train.seq_len)  # the model's own sizes: checked on load
        hf_config = _hf_config_dict(cfg)
    mpu = parallel.initialize(layout, seed=cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    out = Path(str(cfg.output_dir))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "config.resolved.json", cfg.to_dict())
    _log(f"{world} ranks, {layout.describe()}, global batch {run_plan.global_batch} = micro "
         f"{run_plan.micro_batch} x {run_plan.grad_accum} accumulation x dp {layout.dp}")
    return mpu, run_plan, hf_config


def _prepare(cfg: TrainConfig, mpu, run_plan: cfgmod.RunPlan,
             hf_config: dict[str, Any]) -> RunState:
    """Data, the checked DeepSpeed config, then the model (the costly part comes last)."""
    layout = run_plan.layout
    data = prepare_data_distributed(DataSettings.from_config(cfg), cfg.tokenizer_path,
                                    cfg.data_cache_dir, cfg.data.num_proc)
    total = cfg.train.steps or cfgmod.total_steps(cfg, len(data.train), run_plan.global_batch)
    with runtime.failing_together():  # sized from this node's memory; written on rank 0
        ds_config, notes = deepspeed_config(cfg, run_plan, hf_config, total)
        check_supported(ds_config, pp=layout.pp, has_experts=_has_experts(hf_config))
        if dist.get_rank() == 0:
            _write_json(Path(str(cfg.output_dir)) / "ds_config.json", ds_config)
    for note in notes:
        _log(f"deepspeed: {note}")
    chunks, adapter = build_model(cfg, layout)
    vocab = adapter.dims.vocab
    for split in ("train", "validation"):
        top = data.meta.get(split, {}).get("max_token_id")
        if top is not None and top >= vocab:
            raise ConfigError(f"data: token id {top} in the {split} split is outside the model's "
                              f"vocab ({vocab}): the tokenizer does not belong to this model.")
    mask_vocab_padding(chunks, vocab)
    sampler = GlobalBatchSampler(len(data.train), run_plan.global_batch, run_plan.micro_batch,
                                 layout.dp, mpu.get_data_parallel_rank_without_cp(), cfg.train.seed,
                                 cfg.data.shuffle)
    return RunState(cfg, run_plan, hf_config, data, sampler, list(chunks), adapter, ds_config,
                    notes, total)


def _train(state: RunState, engine) -> TrainResult:
    """Resume, the step loop (metrics, eval, checkpoints), the HF export."""
    cfg, data = state.cfg, state.data
    rank = dist.get_rank()
    out = Path(str(cfg.output_dir))
    total = state.total_steps
    start = _resume(state, engine)
    result = TrainResult(steps=total, start_step=start, ds_config=state.ds_config,
                         ds_notes=state.ds_notes)
    writer = MetricsWriter(out, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                           wandb_project=cfg.logging.wandb_project,
                           run_config=cfg.to_dict()) if rank == 0 else None
    if data.validation is not None and cfg.train.eval_interval and start == 0:
        result.val_losses[0] = _validation_loss(state)
        _log(f"validation loss before training: {result.val_losses[0]:.4f}")
    progress = _progress(total, start) if rank == 0 else None
    from toolkit.train import faults  # imported here: the import block is shared with reshard

    stop = faults.StopGuard(faults.stop_file(out))
    heartbeat = faults.Heartbeat(cfg.runtime.heartbeat_timeout_s, rank)
    try:
        with stop, heartbeat:
            _loop(state, engine, result, start, stop, heartbeat, writer, progress)
    finally:
        if writer is not None:
            writer.close()
        if progress is not None:
            progress.close()
    if cfg.export.hf_dir:
        result.export_dir, result.export_max_abs_diff = export(
            engine, state.chunks, state.adapter, cfg.export.hf_dir, verify=cfg.export.verify)
    if rank == 0:
        summary = dataclasses.asdict(result)
        summary.pop("ds_config")
        _write_json(out / "summary.json", summary)
    return result


def _loop(state: RunState, engine, result: TrainResult, start: int, stop: StopGuard,
          heartbeat: Heartbeat, writer: MetricsWriter | None, progress) -> None:
    """The steps from ``start``; at each boundary a requested stop (``faults``) saves and
    raises ``faults.TrainingStopped`` on every rank."""
    from toolkit.train import faults

    cfg, run_plan, data, sampler = state.cfg, state.plan, state.data, state.sampler
    world, total = dist.get_world_size(), state.total_steps
    schedule = LRSchedule.from_config(cfg.optim, total)
    flops_per_token = model_flops_per_token(state.hf_config, cfg.train.seq_len)
    peak = peak_tflops(device_name(), cfg.logging.peak_tflops)
    tokens_per_step = run_plan.global_batch * cfg.train.seq_len
    if start < total and stop.requested():  # asked before this run trained anything
        raise faults.TrainingStopped(start, None, stop.reason or "")
    saved = start
    for step in range(start, total):
        faults.test_hook("step", step, stop)
        t0 = time.perf_counter()
        res = train_step(engine, state.chunks, step_batches(data.train, sampler, step),
                         num_microbatches=run_plan.grad_accum,
                         micro_batch=run_plan.micro_batch, seq_len=cfg.train.seq_len,
                         lr=schedule(step))
        seconds = time.perf_counter() - t0
        result.losses.append(res.loss)
        done = step + 1
        val = None
        if data.validation is not None and cfg.train.eval_interval and (
                done % cfg.train.eval_interval == 0 or done == total):
            val = _validation_loss(state)
            result.val_losses[done] = val
        if done % cfg.logging.interval == 0 or done == total or val is not None:
            tp = throughput(tokens_per_step, seconds, flops_per_token, world, peak)
            mem = gather_memory()
            if writer is not None:
                writer.log(StepMetrics(
                    step=done, loss=res.loss, lr=res.lr, grad_norm=res.grad_norm,
                    tokens_per_s=tp.tokens_per_s, tflops_per_device=tp.tflops_per_device,
                    mfu=tp.mfu, mem_per_rank=mem, step_time_s=seconds,
                    consumed_samples=sampler.consumed_samples(done), val_loss=val))
        if progress is not None:
            progress.update(done, res.loss, val)
        if cfg.checkpoint.interval and (done % cfg.checkpoint.interval == 0 or done == total):
            _save(state, engine, done)
            saved = done
        heartbeat.beat(done)
        if done < total and stop.requested():
            path = _save(state, engine, done) if saved != done else None
            raise faults.TrainingStopped(done, path and str(path), stop.reason or "")


def _write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=1))


def _validation_loss(state: RunState) -> float:
    """Mean validation loss over the same samples at any layout (forward only)."""
    split, s = state.data.validation, state.sampler
    batches = eval_micro_batches(len(split), s.micro_batch, s.dp_size, s.dp_rank,
                                 state.cfg.train.eval_batches)
    if not batches:
        raise ConfigError(
            f"validation split has {len(split)} samples, fewer than micro_batch*dp = "
            f"{s.micro_batch * s.dp_size}: lower train.eval_interval to 0 or add data.")
    return evaluate(state.chunks, (split.batch(i) for i in batches),
                    num_microbatches=len(batches), micro_batch=s.micro_batch,
                    seq_len=state.cfg.train.seq_len)


def _training_state(state: RunState, step: int) -> TrainingState:
    cfg, plan = state.cfg, state.plan
    return TrainingState(
        step=step, consumed_samples=state.sampler.consumed_samples(step),
        world_size=plan.layout.world_size, dp_size=plan.layout.dp,
        global_batch=plan.global_batch, micro_batch=plan.micro_batch, seed=cfg.train.seed,
        layout=dataclasses.asdict(plan.layout), data_fingerprint=state.data.key,
        config=_absolute_model_paths(cfg.to_dict()),
    )


def _absolute_model_paths(config: dict) -> dict:
    """The config with local model paths made absolute, so that a checkpoint names its HF
    folder wherever it is read from (``mdtk convert`` from another directory); hub ids stay."""
    model = dict(config.get("model") or {})
    for key in ("path", "config", "tokenizer"):
        value = model.get(key)
        if isinstance(value, str) and value and Path(value).exists():
            model[key] = str(Path(value).resolve())
    return {**config, "model": model}


def _save(state: RunState, engine, step: int) -> Path:
    from toolkit.train import faults

    def write_engine(folder: Path) -> None:
        engine.save_checkpoint(str(folder), tag=ENGINE_TAG, save_latest=False)
        faults.test_hook("save", step)  # tests kill a rank here, mid-save

    path = state.checkpoints.save(_training_state(state, step), write_engine)
    _log(f"saved checkpoint {path}")
    return path


def _resume(state: RunState, engine) -> int:
    """The step to start from: 0, or the step of the checkpoint ``checkpoint.resume`` names
    (engine, RNG and data position restored after the run is checked to be the same one)."""
    cfg = state.cfg
    path = state.checkpoints.resolve_resume(cfg.checkpoint.resume)
    if path is None:
        return 0
    saved = load_training_state(path)
    # Another layout (or ZeRO stage): resharded through the mapping; the same one: DeepSpeed's
    # native load of its per-rank shards.
    stage = reshard.saved_stage(path)
    native = (reshard.same_layout(saved.layout, state.plan.layout)
              and stage == engine.zero_optimization_stage())
    check_resume(saved, layout=state.plan.layout, global_batch=state.plan.global_batch,
                 seed=cfg.train.seed, data_fingerprint=state.data.key,
                 dp_change_ok=state.sampler.supports_dp_change, reshard_ok=True)
    if native:
        loaded, _ = engine.load_checkpoint(str(path), tag=ENGINE_TAG)
        if loaded is None:
            raise ConfigError(f"checkpoint {path}: DeepSpeed found no engine state under tag "
                              f"{ENGINE_TAG!r} (incomplete or foreign checkpoint).")
    else:
        reshard.load_resharded(path, engine, state.chunks, state.adapter, saved.step,
                               saved.consumed_samples)
    # RNG states belong to the ranks of the saved layout: elsewhere reseed per step
    if not native or not load_rng(path, dist.get_rank()):
        torch.manual_seed(cfg.train.seed + saved.step)
    how = "" if native else f" (resharded from {_describe(saved.layout)}, ZeRO-{stage})"
    _log(f"resumed from {path} at step {saved.step}{how}")
    return saved.step


def _describe(layout: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items()
                    if k in ("dp", "tp", "pp", "vpp", "ep") and v not in (None, 1)) or "1 rank"


def export(engine, chunks, adapter, out_dir: str, *, verify: bool = True
           ) -> tuple[str | None, float | None]:
    """HF folder from the trained weights (ZeRO-3 parameters gathered first).

    With ``verify`` the folder is loaded back with transformers on rank 0 and its logits are
    compared with the live model's on a fixed batch: returns (folder, max abs logit diff).
    """
    import contextlib

    from toolkit.adapters.live import export_hf

    gathered = contextlib.nullcontext()
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([p for c in chunks for p in c.parameters()])
    diff = None
    with gathered:
        path = export_hf(chunks, adapter, out_dir, overwrite=True)
        if verify:
            diff = _verify_export(chunks, adapter, out_dir)
    if path is not None:
        _log(f"exported HF checkpoint to {path}"
             + (f" (logits vs trained model: max abs diff {diff:.2e})" if verify else ""))
    return (str(path) if path is not None else None), diff


def _verify_export(chunks, adapter, out_dir: str) -> float:
    """Max abs logit difference, HF export (transformers) vs the live model; on every rank."""
    from toolkit.adapters.live import forward_logits
    from toolkit.convert.verify import fixed_tokens, run_hf

    vocab = adapter.dims.vocab
    tokens = fixed_tokens(vocab, batch=2, seq_len=16)
    live = forward_logits(chunks, tokens, vocab).float().cpu()
    for chunk in chunks:
        chunk.train()
    diff = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" of the folder just written
        hf = run_hf(Path(out_dir), tokens).logits.float()
        diff[0] = (hf - live).abs().max().item()
    dist.broadcast(diff, 0)
    return float(diff[0])


class _progress:
    """A rich progress bar with the latest loss (rank 0 only)."""

    def __init__(self, total: int, start: int):
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("train"), BarColumn(), TextColumn("{task.completed}/"
                            "{task.total}"), TextColumn("{task.fields[info]}"),
                            TimeRemainingColumn(), transient=False)
        self.task = self.bar.add_task("train", total=total, completed=start, info="")
        self.bar.start()

    def update(self, done: int, loss: float, val: float | None) -> None:
        info = f"loss {loss:.4f}" + (f" val {val:.4f}" if val is not None else "")
        self.bar.update(self.task, completed=done, info=info)

    def close(self) -> None:
        self.bar.stop()
