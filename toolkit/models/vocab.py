"""The padded rows of a vocabulary split over tensor-parallel ranks: masked out of the softmax,
for training (the loss), validation and generation (sampling) alike."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core import parallel_state as ps


def mask_vocab_padding(chunks: Sequence[torch.nn.Module], vocab_size: int) -> int:
    """Give the padded vocab columns of the output layer a logit of -inf; returns their count.

    With tp>1 the embedding and output layer are padded to a multiple of tp. The padded rows are
    zeros, so their logits (0) would enter the softmax of megatron-core's
    ``vocab_parallel_cross_entropy`` and the loss would differ from the unpadded model's
    (Megatron-LM issue 1754). -inf makes them vanish from the softmax and get no gradient.
    """
    masked = 0
    for chunk in chunks:
        if not getattr(chunk, "post_process", False) or getattr(
                chunk.output_layer, "is_score_head", False):  # a reward model: no vocab out
            continue
        padded = int(chunk.vocab_size)  # GPTModel's (padded) vocab
        if padded <= vocab_size:
            continue
        masked = padded - vocab_size
        if getattr(chunk, "_mdtk_vocab_masked", None) != vocab_size:  # once per chunk
            chunk.output_layer.register_forward_hook(_vocab_mask_hook(vocab_size, padded))
            chunk._mdtk_vocab_masked = vocab_size
    return masked


def _vocab_mask_hook(vocab_size: int, padded: int):
    def hook(module, args, output):
        logits, bias = output
        width = logits.shape[-1]
        # this rank's columns: all of them when the output was gathered, else its tp partition
        first = 0 if width == padded else ps.get_tensor_model_parallel_rank() * width
        if first + width <= vocab_size:
            return output
        cols = torch.arange(first, first + width, device=logits.device) >= vocab_size
        return logits.masked_fill(cols, float("-inf")), bias

    return hook
