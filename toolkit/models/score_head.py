"""A reward model's scalar head in place of the LM head (``data.mode: reward``).

HF's ``AutoModelForSequenceClassification`` puts ``score`` (Linear(hidden, num_labels, no
bias)) on the final norm's output and reads the score of each sequence's last non-padding token.
Here the head replaces the GPTModel's ``output_layer`` on the last pipeline stage, so megatron-
core's ``_postprocess`` runs it where it ran the LM head and the model returns a score per
position ([b, s, 1], called with ``labels=None``); the loss picks the last token's
(``toolkit.train.objectives.reward``). Its weight ``output_layer.weight`` [1, hidden] is
replicated over tensor-parallel ranks (the mapping's ``score.weight``).

Under sequence parallelism the final norm's output is split over the tp ranks along the
sequence: it is gathered first, and its backward splits (not sums) the gradient, because every
tp rank computes the same scores from the same gathered values. The embedding stays untied:
a reward model has no LM head to share it with (at pp > 1 the last stage's copy of a tied
embedding would otherwise be summed with a head of another shape).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from toolkit.models.seeding import tensor_seed

NAME = "output_layer.weight"  # the megatron-core name of the head's weight


class ScoreHead(torch.nn.Module):
    """``forward(hidden [s, b, h]) -> (scores [s, b, 1], None)``, as an output layer returns."""

    is_score_head = True

    def __init__(self, hidden: int, dtype: torch.dtype, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import (
                gather_from_sequence_parallel_region,
            )

            hidden = gather_from_sequence_parallel_region(hidden,
                                                          tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight), None


def attach_score_heads(chunks: Sequence[torch.nn.Module]) -> int:
    """Replace the output layer of the last stage's chunk by a ``ScoreHead`` (zeros: filled from
    a checkpoint or ``seed_score``); untie every chunk's embedding. Returns heads attached."""
    attached = 0
    for chunk in chunks:
        chunk.share_embeddings_and_output_weights = False
        if not getattr(chunk, "post_process", False):
            continue
        config = chunk.config
        chunk.output_layer = ScoreHead(config.hidden_size, config.params_dtype,
                                       bool(config.sequence_parallel))
        attached += 1
    return attached


def score_heads(chunks: Sequence[torch.nn.Module]) -> list[ScoreHead]:
    return [c.output_layer for c in chunks
            if isinstance(getattr(c, "output_layer", None), ScoreHead)]


def seed_score(chunks: Sequence[torch.nn.Module], seed: int, std: float) -> None:
    """A new head's weight: normal(0, std) (transformers' init of ``score``, std = the config's
    ``initializer_range``) drawn whole from (seed, name), the same at every layout."""
    for head in score_heads(chunks):
        g = torch.Generator().manual_seed(tensor_seed(seed, "score.weight"))
        full = torch.empty(head.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
        with torch.no_grad():
            head.weight.copy_(full.to(head.weight))
