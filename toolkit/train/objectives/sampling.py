"""Completions sampled on the training ranks, from the policy's live chunks (GRPO's rollouts,
on-policy distillation): the generation engine built once per run, and what it refuses."""

from __future__ import annotations

from typing import Any

from toolkit.errors import ConfigError


def live_generator(s: Any, max_batch: int, eos_ids: list[int], what: str, instead: str) -> Any:
    """An ``infer.Generator`` on ``s.chunks`` (the run's ``ObjectiveSetup``) for at most
    ``max_batch`` prompts a call, the chunks back in training mode; refused (``what`` is
    generated, ``instead`` says the alternative) with virtual pipeline stages. Under ZeRO-3
    the engine's forwards gather the partitions as training's do (``infer.engine``)."""
    from toolkit.infer.engine import Generator

    if len(s.chunks) != 1:
        raise ConfigError(f"{what} generated on the training ranks with parallel.vpp="
                          f"{s.cfg.parallel.vpp}: the generation engine runs one model chunk per "
                          f"rank; drop vpp{instead}.")
    engine = Generator(s.chunks, eos_ids=eos_ids, vocab_size=s.policy.shape.vocab,
                       max_seq_len=s.cfg.train.seq_len + 1, max_batch=max_batch)
    for chunk in s.chunks:
        chunk.train()
    return engine


def policy_eos_ids(policy: Any, tokenizer: Any) -> list[int]:
    """The ids that end a completion of the policy (its generation config's first)."""
    from pathlib import Path

    from toolkit.infer.load import eos_ids

    return eos_ids(policy, Path(str(policy.source or ".")), tokenizer)
