"""Completions sampled on the training ranks, from the policy's live chunks (GRPO's rollouts,
on-policy distillation): the generation engine built once per run."""

from __future__ import annotations

from typing import Any


class LiveSampler:
    """The generation engine on the policy's live chunks: ``sample`` draws completions (the
    engine's bars off: the training run's bar is the one shown) and puts the chunks back in
    training mode (the engine switches them to eval)."""

    def __init__(self, engine: Any, chunks: list[Any]):
        self.engine, self.chunks = engine, chunks

    def sample(self, prompts: list[list[int]], sampling: Any, logprobs: bool = False) -> list:
        from toolkit.infer.run import no_progress_bars

        try:
            with no_progress_bars():
                return self.engine.generate(prompts, sampling, logprobs=logprobs)
        finally:
            for chunk in self.chunks:
                chunk.train()


def live_generator(s: Any, max_batch: int, eos_ids: list[int]) -> LiveSampler:
    """A ``LiveSampler`` on ``s.chunks`` (the run's ``ObjectiveSetup``; with virtual pipeline
    stages all of them) for at most ``max_batch`` prompts a call. Under ZeRO-3 the engine's
    forwards gather the partitions as training's do (``infer.engine``)."""
    from toolkit.infer.engine import Generator

    engine = Generator(s.chunks, eos_ids=eos_ids, vocab_size=s.policy.shape.vocab,
                       max_seq_len=s.cfg.train.seq_len + 1, max_batch=max_batch)
    sampler = LiveSampler(engine, list(s.chunks))
    for chunk in sampler.chunks:
        chunk.train()
    return sampler


def policy_eos_ids(policy: Any, tokenizer: Any) -> list[int]:
    """The ids that end a completion of the policy (its generation config's first)."""
    from pathlib import Path

    from toolkit.infer.load import eos_ids

    return eos_ids(policy, Path(str(policy.source or ".")), tokenizer)
