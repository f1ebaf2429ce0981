"""The ``eval:`` section during training: lm-eval tasks and generated samples on the live model
(this rank's chunks at the run's layout, megatron-core's inference path: ``toolkit.infer``),
every ``eval.interval`` steps and at the end. The chunks go back to training mode after."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from toolkit.train.run_state import RunState


@dataclass
class Evals:
    """What the eval section runs, made once per run (the tokenizer, the task manager)."""

    state: RunState
    tokenizer: Any
    manager: Any  # lm-eval's TaskManager (None without tasks)

    @classmethod
    def of(cls, state: RunState) -> Evals | None:
        e = state.cfg.eval
        if not e.active:
            return None
        from transformers import AutoTokenizer

        from toolkit.infer.run import check_tasks

        manager = check_tasks(list(e.tasks), e.include_path) if e.tasks else None
        return cls(state, AutoTokenizer.from_pretrained(state.cfg.tokenizer_path), manager)

    def due(self, done: int, total: int) -> bool:
        every = self.state.cfg.eval.interval
        return done == total or bool(every and done % every == 0)

    def run(self, step: int, log: Any) -> dict[str, float]:
        """The tasks' metrics (``eval/TASK/METRIC``, the same on every rank) and the samples
        (printed and appended to ``samples.jsonl`` by rank 0)."""
        from toolkit.infer.run import no_progress_bars

        try:
            with no_progress_bars():
                metrics = self._tasks(log, step) if self.manager is not None else {}
                if self.state.cfg.eval.samples:
                    self._samples(step, log)
        finally:
            for chunk in self.state.chunks:
                chunk.train()
        return metrics

    def _loaded(self) -> Any:
        from toolkit.infer.load import Loaded

        s = self.state
        folder = Path(s.cfg.model.path) if s.cfg.model.path else Path(s.cfg.tokenizer_path)
        return Loaded.of(s.chunks, s.adapter, s.model.spec, self.tokenizer, folder)

    def _tasks(self, log: Any, step: int) -> dict[str, float]:
        from toolkit.infer.run import metric_names, run_tasks

        e = self.state.cfg.eval
        res = run_tasks(self._loaded(), list(e.tasks), self.manager, num_fewshot=e.num_fewshot,
                        limit=e.limit)
        box = [None if res is None else {
            f"eval/{task}/{name.split(',')[0]}": float(value)
            for task, metrics in res["results"].items() for name, value in metrics.items()
            if name in metric_names(res, task)}]
        dist.broadcast_object_list(box, src=0)  # lm-eval gives the results to rank 0 only
        metrics = box[0] or {}
        if metrics:
            log(f"step {step} eval: " + ", ".join(f"{k[5:]} {v:.4g}" for k, v in metrics.items()))
        return metrics

    def _samples(self, step: int, log: Any) -> None:
        from toolkit.infer.engine import Generator, Sampling
        from toolkit.infer.prompts import output_row, read_prompts

        e, loaded = self.state.cfg.eval, self._loaded()
        prompts = read_prompts(e.samples, self.tokenizer)
        longest = max(len(p.ids) for p in prompts) + e.max_new_tokens
        gen = Generator(loaded.chunks, eos_ids=loaded.eos_ids, vocab_size=loaded.adapter.dims.vocab,
                        max_seq_len=longest, max_batch=len(prompts), decode=self.tokenizer.decode)
        done = gen.generate([p.ids for p in prompts], Sampling(max_new_tokens=e.max_new_tokens))
        if dist.get_rank() != 0:
            return
        rows = [{"step": step, **output_row(p, c.completion_ids, c.finish_reason, self.tokenizer)}
                for p, c in zip(prompts, done, strict=True)]
        out = Path(str(self.state.cfg.output_dir)) / "samples.jsonl"
        with open(out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for r in rows:
            log(f"step {step} sample: {r['prompt']!r} -> {r['completion']!r}")
