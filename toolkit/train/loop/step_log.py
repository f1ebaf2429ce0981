"""The training loop's per-step bookkeeping: steps are queued with their values still on the
device (``step_values.PendingStep``) and read in one go when something needs them: a metrics line
(every ``logging.interval`` steps and at the end), a validation, a checkpoint (a non-finite loss
must stop the run before it is saved), a stop. Between reads the host runs ahead of the GPU.

Throughput is the wall time of the steps since the last read, divided by their number: with the
values read lazily, a step's own host time says nothing about the device's. Time spent in
validation and checkpoints (``paused``) is left out, as the step time always left it out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from toolkit.train.loop.metrics import MetricsWriter, StepMetrics, gather_memory, throughput
from toolkit.train.loop.step_values import PendingStep, StepResult, resolve_steps


@dataclass
class StepLog:
    """Queues a run's steps and writes what they produced (``results``: every step's values,
    in order, once read; ``losses``/``metrics`` of the run's result are filled from them)."""

    interval: int
    tokens_per_step: int
    flops_per_token: float
    world: int
    peak: float | None
    writer: MetricsWriter | None
    progress: Any  # the rank-0 progress bar (``update(done, loss, val)``) or None
    record: Callable[[StepResult], None]  # called once per step, in order, when it is read
    extra: Callable[[int, StepResult], dict[str, Any]] = lambda done, res: {}  # more fields
    shown: tuple[str, ...] = ()  # the objective's metrics the progress bar shows beside the loss
    pending: list[PendingStep] = field(default_factory=list)
    last: StepResult | None = None
    _since: float = field(default_factory=time.perf_counter)
    _paused: float = 0.0
    _steps: int = 0

    def add(self, step: PendingStep, done: int, *, due: bool) -> None:
        """Queue step ``done``'s values; read them (with the queued ones) if ``due``."""
        self.pending.append(step)
        self._steps += 1
        if due:
            self.read()
        if self.progress is not None:
            self.progress.update(done, None if self.last is None else self.last.loss, None)

    def read(self) -> None:
        """Read every queued step's values (one reduction) and record them."""
        for result in resolve_steps(self.pending):
            self.record(result)
            self.last = result
        self.pending.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside this block (validation, checkpoints) does not count as step time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start

    def line(self, done: int, val: float | None, consumed: int) -> None:
        """Read the queued steps and write the metrics line of step ``done`` (rank 0 writes;
        every rank takes part in the memory gather)."""
        self.read()
        seconds = (time.perf_counter() - self._since - self._paused) / max(self._steps, 1)
        tp = throughput(self.tokens_per_step, seconds, self.flops_per_token, self.world,
                        self.peak)
        mem = gather_memory()
        res = self.last
        assert res is not None, "a metrics line before any step"
        extra = self.extra(done, res)
        if self.writer is not None:
            self.writer.log(StepMetrics(
                step=done, loss=res.loss, lr=res.lr, grad_norm=res.grad_norm,
                tokens_per_s=tp.tokens_per_s, tflops_per_device=tp.tflops_per_device,
                mfu=tp.mfu, mem_per_rank=mem, step_time_s=seconds, consumed_samples=consumed,
                val_loss=val, **extra))
        if self.progress is not None:
            metrics = extra.get("extra", {})
            self.progress.update(done, res.loss, val, {
                k[5:]: v for k, v in metrics.items() if k.startswith("eval/")},
                {k: metrics[k] for k in self.shown if k in metrics})
        self._since, self._paused, self._steps = time.perf_counter(), 0.0, 0


class Progress:
    """A rich progress bar with the latest loss (rank 0 only)."""

    def __init__(self, total: int, start: int):
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("train"), BarColumn(), TextColumn("{task.completed}/"
                            "{task.total}"), TextColumn("{task.fields[info]}"),
                            TimeRemainingColumn(), transient=False)
        self.task = self.bar.add_task("train", total=total, completed=start, info="")
        self._evals: dict[str, float] = {}
        self.bar.start()

    def update(self, done: int, loss: float | None, val: float | None,
               evals: dict[str, float] | None = None,
               shown: dict[str, float] | None = None) -> None:
        """``loss``: the latest step's that was read (None before the first); ``evals``: the
        eval section's metrics of this step, the first shown until the next ones (the line
        must fit a terminal: all of them are in the log line and metrics.jsonl); ``shown``:
        the objective's headline metrics of the step (GRPO's reward)."""
        self._evals = dict(list((evals or {}).items())[:1]) or self._evals
        info = ("" if loss is None else f"loss {loss:.4f}") + "".join(
            f" {k} {v:.3g}" for k, v in (shown or {}).items()) + (
            f" val {val:.4f}" if val is not None else "") + "".join(
            f" {k} {v:.3g}" for k, v in self._evals.items())
        self.bar.update(self.task, completed=done, info=info)

    def close(self) -> None:
        self.bar.stop()
