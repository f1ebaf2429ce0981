"""megatron-core's ``GPTModel`` whose rotary embeddings follow the micro-batch's position ids
when examples are packed (``toolkit.models.packed``).

megatron-core computes RoPE for positions ``0..s-1`` of every row whatever the position ids
say (they feed only learned absolute embeddings). RoPE is relative, but only in exact
arithmetic: in fp32 the angle of position 4000 is rounded by ~2e-4 rad, so an example packed at
offset 4000 would not see what it sees alone. With :class:`~toolkit.models.packed.Segments`,
the model's own rotary table is indexed by each token's position id (``per_token_rope``:
[s, b, 1, d], which megatron-core's RoPE broadcasts like its [s, 1, 1, d]); without, nothing
changes.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel as _MegatronGPTModel

from toolkit.models.packed import Segments


def per_token_rope(rotary: torch.nn.Module, segments: Segments) -> torch.Tensor:
    """Rotary frequencies [s, b, 1, d] for this rank's position ids, from ``rotary`` (a
    megatron-core RotaryEmbedding / YarnRotaryEmbedding) over the full row length; the table is
    taken unsliced (``packed_seq=True``) because the position ids are already this rank's."""
    table = rotary(segments.seq_len, packed_seq=True)
    if isinstance(table, tuple):  # YaRN returns (freqs, mscale); mscale is applied elsewhere
        table = table[0]
    pos = segments.position_ids.to(table.device)
    return table[:, 0, 0][pos].transpose(0, 1).unsqueeze(2).contiguous()


class GPTModel(_MegatronGPTModel):
    """megatron-core's GPTModel; with packed examples its RoPE restarts at every example.

    With ``linear_ce_vocab`` set (``toolkit.models.kernels``: Liger's fused linear
    cross-entropy) a forward given ``labels`` and a ``loss_mask`` returns the sum of the losses
    of the tokens the mask keeps (a 0-d tensor) without materialising the logits; without a
    ``loss_mask`` it returns the per-token losses as megatron-core does."""

    linear_ce_vocab: int | None = None  # the real vocabulary (padded rows left out)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        segments = packed_seq_params if isinstance(packed_seq_params, Segments) else None
        out = super()._preprocess(input_ids, position_ids, decoder_input, inference_context,
                                  None if segments else packed_seq_params, padding_mask)
        if segments is None or out[1] is None:
            return out
        return (out[0], per_token_rope(self.rotary_pos_emb, segments), *out[2:])

    def _postprocess(self, **kwargs):
        labels, mask = kwargs.get("labels"), kwargs.get("loss_mask")
        if (self.linear_ce_vocab is None or labels is None or mask is None
                or not self.post_process or self.config.mtp_num_layers):
            return super()._postprocess(**kwargs)
        weight = (self.shared_embedding_or_output_weight()
                  if self.share_embeddings_and_output_weights else self.output_layer.weight)
        return linear_cross_entropy_sum(kwargs["hidden_states"], weight[:self.linear_ce_vocab],
                                        labels, mask)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             mask: torch.Tensor) -> torch.Tensor:
    """Sum over the kept tokens of ``-log softmax(hidden @ weight.T)[label]`` by Liger's fused
    kernel (vocabulary chunks; the gradients of ``hidden`` and ``weight`` are computed in the
    forward, accumulated in fp32). ``hidden`` [s, b, h] as the decoder gives it; ``labels``,
    ``mask`` [b, s] with a 0/1 mask: a dropped token gets label -100 (Liger's ignore index)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    target = labels.masked_fill(mask == 0, -100).transpose(0, 1).reshape(-1)
    return liger_fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, target,
                                            ignore_index=-100, reduction="sum",
                                            accum_dtype=torch.float32)
