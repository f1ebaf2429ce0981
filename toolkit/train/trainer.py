"""The training loop: config -> layout -> model (adapters) -> DeepSpeed engine -> steps.

Every rank runs ``run(cfg)`` (launched by torchrun, the deepspeed launcher or srun). The pieces
live in their own modules; this one only wires them in order:
config.plan (layout, batches) and model.RunModel (the ModelSpec: config.json read once)
-> parallel.initialize -> data.prepare_data_distributed -> ds_config.deepspeed_config
(dsconfig.training: generated or the user's JSON, linted; the engine's rules checked) ->
model.build_model -> engine.build_engine -> resume -> train_step loop (metrics,
engine.evaluate, checkpoints) -> export.export (HF folder). The phases hand each other one
``RunState``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from toolkit import parallel, runtime
from toolkit.atomic import write_text
from toolkit.parallel import LayoutError
from toolkit.train import config as cfgmod
from toolkit.train.checkpoints.state import ResumeError, load_training_state
from toolkit.train.config import ConfigError, TrainConfig
from toolkit.train.data import (
    DataError,
    DataSettings,
    GlobalBatchSampler,
    prepare_data_distributed,
    with_reset_at_eod,
)
from toolkit.train.data.blend import SourceTokens
from toolkit.train.data.pretrain import check_token_ids
from toolkit.train.ds_config import deepspeed_config
from toolkit.train.loop.engine import (
    EngineError,
    build_engine,
    mask_vocab_padding,
    run_step,
)
from toolkit.train.loop.evals import Evals
from toolkit.train.loop.metrics import (
    MetricsWriter,
    device_name,
    model_flops_per_token,
    peak_tflops,
)
from toolkit.train.loop.schedule import LRSchedule
from toolkit.train.loop.step_log import Progress, StepLog
from toolkit.train.loop.step_values import StepResult
from toolkit.train.loop.validation import validation_metrics
from toolkit.train.loop.zero3_release import destroy_engine
from toolkit.train.model import RunModel, build_model, check_packing, run_kernels
from toolkit.train.objectives.registry import (
    ObjectiveSetup,
    before_policy,
    objective_data,
    objective_for,
)
from toolkit.train.run_state import RunState, TrainResult
from toolkit.train.run_state import log as _log
from toolkit.train.variants import variant_for

if TYPE_CHECKING:
    from toolkit.train.checkpoints.saver import Saver
    from toolkit.train.loop.faults import Heartbeat, StopGuard


# -- the run ---------------------------------------------------------------------------------------

def run(cfg: TrainConfig) -> TrainResult:
    """Train as ``cfg`` says on every rank of the launch (without one: a world of one,
    ``runtime.joined``). Every refusal (layout, DeepSpeed config, resume) is a ``ConfigError``
    raised before the engine starts, and before anything is written (``_record``). Groups and
    engine are torn down on the way out, also after an error: ``run`` can run again (tests)."""
    runtime.enable_cpu_mode()
    with runtime.joined():  # no launcher: a world of one, ended on the way out
        engine = state = None
        try:
            mpu, run_plan, model = _setup(cfg)
            state = _prepare(cfg, mpu, run_plan, model)
            _record(state)
            engine = build_engine(state.chunks, mpu, state.ds_config, checked=True)
            return _train(state, engine)
        except (LayoutError, EngineError, ResumeError, DataError) as e:
            raise ConfigError(str(e)) from e
        finally:
            if state is not None:
                state.objective.close()
            if engine is not None:
                destroy_engine(engine)
            parallel.destroy()


def _setup(cfg: TrainConfig) -> tuple[Any, cfgmod.RunPlan, RunModel]:
    """Layout checks that need no model, the model's config, then megatron-core's process
    groups (``parallel.initialize`` refuses what this installation cannot run, before any
    group)."""
    world = dist.get_world_size()
    with runtime.failing_together():  # e.g. a model folder missing on one node only
        run_plan = cfgmod.plan(cfg, world)
        layout = run_plan.layout
        layout.validate_seq_len(cfg.train.seq_len)
        model = RunModel.of(cfg)
        model.adapter.validate(layout)  # the model's sizes, before any data or process group
        if cfg.data.mode == "pretrain":  # indexed sources' token ids vs the vocab, scanned once
            check_token_ids(cfg.data.sources + cfg.data.validation_sources, cfg.data_cache_dir,
                            model.shape.vocab)
    mpu = parallel.initialize(layout, seed=cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    alone = " (one process: no launcher)" if runtime.alone() else ""
    _log(f"{world} ranks{alone}, {layout.describe()}, global batch {run_plan.global_batch} = micro "
         f"{run_plan.micro_batch} x {run_plan.grad_accum} accumulation x dp {layout.dp}")
    return mpu, run_plan, model


def _record(state: RunState) -> None:
    """config.resolved.json and ds_config.json (rank 0), once config, model, data and DeepSpeed
    settings are checked: a refused run writes nothing (the data cache only when complete)."""
    with runtime.failing_together():  # e.g. output_dir not writable: every rank stops
        if dist.get_rank() == 0:
            out = Path(str(state.cfg.output_dir))
            out.mkdir(parents=True, exist_ok=True)
            _write_json(out / "config.resolved.json", state.cfg.to_dict())
            _write_json(out / "ds_config.json", state.ds_config)


def _prepare(cfg: TrainConfig, mpu, run_plan: cfgmod.RunPlan, model: RunModel) -> RunState:
    """Data, the checked DeepSpeed config, then the model (the costly part comes last)."""
    layout = run_plan.layout
    t0 = time.perf_counter()
    data = objective_data(cfg) or with_reset_at_eod(prepare_data_distributed(
        DataSettings.from_config(cfg), cfg.tokenizer_path, cfg.data_cache_dir,
        cfg.data.num_proc), cfg.data.reset_at_eod)
    if getattr(data.train, "packed", False) or data.train.reset_eod is not None:
        _log(check_packing(cfg, layout, model))  # refused here when the model cannot
    total = cfg.train.steps or cfgmod.total_steps(cfg, len(data.train), run_plan.global_batch)
    data.train.reserve(total * run_plan.global_batch)
    _log(f"data ready in {time.perf_counter() - t0:.2f} s")
    if runtime.use_cuda():
        _log(run_kernels(cfg, layout)[1])
    with runtime.failing_together():  # sized from this node's memory
        ds_config, notes = deepspeed_config(cfg, run_plan, model, total)
    for note in notes:
        _log(f"deepspeed: {note}")
    dp_rank = mpu.get_data_parallel_rank_without_cp()
    # DPO's reference log-probabilities, computed before the policy exists (or None)
    precomputed = before_policy(cfg, layout, mpu, ds_config, data, run_plan.micro_batch,
                                dp_rank, model.spec)
    chunks, adapter = build_model(cfg, layout, model)
    vocab = adapter.dims.vocab
    for split in ("train", "validation"):
        top = data.meta.get(split, {}).get("max_token_id")
        if top is not None and top >= vocab:
            raise ConfigError(f"data: token id {top} in the {split} split is outside the model's "
                              f"vocab ({vocab}): the tokenizer does not belong to this model.")
    mask_vocab_padding(chunks, vocab)
    variant = variant_for(cfg).attach(cfg, chunks, adapter)  # e.g. adds trained adapters
    num_samples, shuffle = data.train.sampler_args(cfg.data.shuffle)
    sampler = GlobalBatchSampler(num_samples, run_plan.global_batch, run_plan.micro_batch,
                                 layout.dp, dp_rank, cfg.train.seed, shuffle)
    objective = objective_for(ObjectiveSetup(cfg, layout, mpu, ds_config, model.spec,
                                             list(chunks), run_plan.global_batch, precomputed,
                                             data, adapter))
    return RunState(cfg, run_plan, model, data, sampler, list(chunks), adapter, ds_config,
                    notes, total, objective, variant)


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
        _validate(state, result, 0)
        _log(f"validation loss before training: {result.val_losses[0]:.4f}")
    progress = Progress(total, start) if rank == 0 else None
    from toolkit.train.checkpoints.saver import Saver
    from toolkit.train.loop import faults  # imported here: the import block is shared

    stop = faults.StopGuard(faults.stop_file(out))
    heartbeat = faults.Heartbeat(cfg.runtime.heartbeat_timeout_s, rank)
    saver = Saver(state.checkpoints, asynchronous=cfg.checkpoint.async_,
                  on_error=cfg.checkpoint.on_save_error, log=_log)
    try:
        if start < total and state.variant.uses_saver:
            saver.prepare(engine)
        with stop, heartbeat:
            _loop(state, engine, result, start, stop, heartbeat, saver, writer, progress,
                  Evals.of(state))
    finally:
        saver.close()
        if writer is not None:
            writer.close()
        if progress is not None:
            progress.close()
    state.variant.export(state, engine, result)
    if rank == 0:
        summary = dataclasses.asdict(result)
        summary.pop("ds_config")
        _write_json(out / "summary.json", summary)
    return result


def _loop(state: RunState, engine, result: TrainResult, start: int, stop: StopGuard,
          heartbeat: Heartbeat, saver: Saver, writer: MetricsWriter | None, progress,
          evals: Evals | None) -> None:
    """The steps from ``start``; at each boundary the save in flight is published when written
    (``saver.poll``) and a requested stop (``faults``) saves, waits for the save and raises
    ``faults.TrainingStopped`` on every rank. The run's end waits for the last save."""
    from toolkit.train.loop import faults

    cfg, run_plan, data, sampler = state.cfg, state.plan, state.data, state.sampler
    total, objective = state.total_steps, state.objective
    schedule = LRSchedule.from_config(cfg.optim, total)
    if start < total and stop.requested():  # asked before this run trained anything
        raise faults.TrainingStopped(start, None, stop.reason or "")
    saved = start
    fed = SourceTokens.of(data.train, cfg.train.seq_len, run_plan.global_batch, start)
    log = _step_log(state, result, writer, progress, fed)
    for step in range(start, total):
        faults.test_hook("step", step, stop)
        batches = objective.batches("train", data.train, sampler.micro_batches(step))
        pending = run_step(engine, state.chunks, batches, num_microbatches=run_plan.grad_accum,
                           micro_batch=run_plan.micro_batch, seq_len=cfg.train.seq_len,
                           lr=schedule(step), loss_fn=objective.loss_fn,
                           rows_per_sample=objective.rows_per_sample)
        done = step + 1
        if fed is not None:
            fed.add(step)
        val = None
        if data.validation is not None and cfg.train.eval_interval and (
                done % cfg.train.eval_interval == 0 or done == total):
            with log.paused():
                val = _validate(state, result, done)
        tasks = evals is not None and evals.due(done, total)
        if tasks:
            with log.paused():
                result.eval_metrics[done] = evals.run(done, _log)
        save = bool(cfg.checkpoint.interval) and (
            done % cfg.checkpoint.interval == 0 or done == total)
        line = done % cfg.logging.interval == 0 or done == total or val is not None or tasks
        log.add(pending, done, due=save)  # a checkpoint never holds a non-finite step
        if line:
            log.line(done, val, sampler.consumed_samples(done))
        if save:
            with log.paused():
                state.variant.save(state, engine, saver, done)
            saved = done
        else:
            saver.poll()
        heartbeat.beat(done)
        if done < total and stop.requested():
            log.read()
            path = state.variant.save(state, engine, saver, done) if saved != done else None
            path = saver.finish() or path
            raise faults.TrainingStopped(done, path and str(path), stop.reason or "")
    log.read()
    saver.finish()


def _step_log(state: RunState, result: TrainResult, writer: MetricsWriter | None, progress,
              fed: SourceTokens | None) -> StepLog:
    """The loop's bookkeeping: every step's values into ``result``, metrics lines to
    ``writer`` (with the tokens fed per source and the validation metrics of the step)."""
    cfg = state.cfg

    def record(res: StepResult) -> None:
        result.losses.append(res.loss)
        result.metrics.append(res.metrics)

    def extra(done: int, res: StepResult) -> dict[str, Any]:
        val = {f"val_{k}": v for k, v in result.val_metrics.get(done, {}).items()}
        return {"tokens_by_source": fed.totals() if fed is not None else None,
                "extra": {**res.metrics, **val, **result.eval_metrics.get(done, {})}}

    return StepLog(
        interval=cfg.logging.interval,
        tokens_per_step=(state.plan.global_batch * cfg.train.seq_len
                         * state.objective.rows_per_sample),
        flops_per_token=model_flops_per_token(state.model.shape, cfg.train.seq_len),
        world=dist.get_world_size(), peak=peak_tflops(device_name(), cfg.logging.peak_tflops),
        writer=writer, progress=progress, record=record, extra=extra,
        shown=state.objective.shown_metrics)


def _write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=1))


def _validate(state: RunState, result: TrainResult, step: int) -> float:
    """Validation loss (and the objective's metrics) over the same samples at any layout,
    forward only, recorded in ``result`` for ``step``; returns the loss."""
    s = state.sampler
    metrics = validation_metrics(state.chunks, state.data.validation, micro_batch=s.micro_batch,
                                 dp_size=s.dp_size, dp_rank=s.dp_rank,
                                 seq_len=state.cfg.train.seq_len,
                                 eval_batches=state.cfg.train.eval_batches,
                                 objective=state.objective)
    result.val_losses[step] = metrics.pop("loss")
    if metrics:
        result.val_metrics[step] = metrics
    return result.val_losses[step]


def _resume(state: RunState, engine) -> int:
    """The step to start from: 0, or the step of the checkpoint ``checkpoint.resume`` names
    (checked to be this run's, then filled by the run's variant: engine, RNG, data position)."""
    cfg = state.cfg
    path = state.checkpoints.resolve_resume(
        cfg.checkpoint.resume, checksums=cfg.checkpoint.verify == "checksums",
        warn=lambda text: _log(f"warning: {text}"))
    if path is None:
        return 0
    saved = load_training_state(path)
    state.check_resume(saved)
    _log(state.variant.resume(state, engine, path, saved))
    return saved.step
