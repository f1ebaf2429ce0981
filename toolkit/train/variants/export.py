"""The trained model as an HF folder at the end of a run, checked against the live model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def export(chunks, adapter, out_dir: str, *, verify: bool = True,
           check: Callable[[list, object, str], float] | None = None,
           ) -> tuple[str | None, float | None]:
    """HF folder from the trained weights (ZeRO-3 parameters gathered first).

    With ``verify`` the folder is loaded back with transformers on rank 0 and its logits are
    compared with the live model's on a fixed batch: returns (folder, max abs logit diff).
    ``check(chunks, adapter, folder)``: another comparison (a reward model's scores).
    """
    from toolkit import runtime
    from toolkit.adapters.live import export_hf

    diff = None
    with runtime.zero3_gathered(p for c in chunks for p in c.parameters()):
        path = export_hf(chunks, adapter, out_dir, overwrite=True)
        if verify:
            diff = (check or verify_export)(chunks, adapter, out_dir)
    return (str(path) if path is not None else None), diff


def verify_export(chunks, adapter, out_dir: str) -> float:
    """Max abs logit difference, HF export (transformers) vs the live model; on every rank."""
    from toolkit.convert.verify import run_hf

    def reference(tokens: torch.Tensor) -> torch.Tensor:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" of the folder just written
        return run_hf(Path(out_dir), tokens).logits

    return verify_against(chunks, adapter, reference)


def verify_against(chunks, adapter, reference: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Max abs logit difference on a fixed batch, ``reference(tokens)`` (run on rank 0) vs the
    live model; on every rank."""
    from toolkit.adapters.live import forward_logits
    from toolkit.convert.verify import fixed_tokens

    vocab = adapter.dims.vocab
    tokens = fixed_tokens(vocab, batch=2, seq_len=16)
    live = forward_logits(chunks, tokens, vocab).float().cpu()
    for chunk in chunks:
        chunk.train()
    diff = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        diff[0] = (reference(tokens).float() - live).abs().max().item()
    dist.broadcast(diff, 0)
    return float(diff[0])
