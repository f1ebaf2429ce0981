"""The validation loss (and the objective's metrics) of a model over a validation split, forward
only: over the whole split (or its first ``eval_batches`` rounds), the last round completed with
filler samples that count for nothing, normalised over all of it (token-weighted; pairs for DPO,
``toolkit.train.loop.loss``), so the same number at any layout, micro-batch and packing."""

from __future__ import annotations

from megatron.core import parallel_state as ps

from toolkit.train.data import eval_micro_batches, eval_rows
from toolkit.train.loop.engine import evaluate_metrics
from toolkit.train.objectives.base import Objective


def validation_loss(chunks, split, **kwargs) -> float:
    """The validation loss alone (:func:`validation_metrics`)."""
    return validation_metrics(chunks, split, **kwargs)["loss"]


def validation_metrics(chunks, split, *, micro_batch: int, dp_size: int, dp_rank: int,
                       seq_len: int, eval_batches: int | None = None,
                       objective: Objective | None = None) -> dict[str, float]:
    """The loss (and the objective's metrics) over the whole validation set (or its first
    ``eval_batches`` rounds; the last round completed with filler samples that count for
    nothing), normalised over all of it: token-weighted (pairs for DPO), the same number at any
    layout, micro-batch and packing."""
    objective = objective or Objective()
    interleaved = len(chunks) > 1  # its schedule wants a multiple of pp micro-batches
    multiple = ps.get_pipeline_model_parallel_world_size() if interleaved else 1
    batches = eval_micro_batches(len(split), micro_batch, dp_size, dp_rank, eval_batches, multiple)
    rows = eval_rows(len(split), micro_batch, dp_size, eval_batches)
    return evaluate_metrics(chunks, objective.batches("validation", split, batches),
                            num_microbatches=len(batches),
                            micro_batch=micro_batch * objective.rows_per_sample,
                            seq_len=seq_len, loss_fn=objective.loss_fn,
                            loss_tokens=split.loss_tokens(rows),
                            samples=len(rows) * objective.rows_per_sample)
