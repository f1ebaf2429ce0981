"""lm-evaluation-harness on the sharded model: an ``lm_eval`` ``TemplateLM`` whose forward is
this rank's megatron-core chunks at any layout (``adapters.live.forward_logits``: tensor-parallel
logits gathered, pipeline stages in order) and whose generation is ``infer.engine.Generator``.

The requests are built as lm-eval's own ``hf`` model builds them, with lm-eval's helpers (the
tokenization switches, the context/continuation split of ``TemplateLM``, the rolling windows of
perplexity tasks, the maximum length), so a task scores the same on the HF folder through
``hf`` and on the sharded model here (tests/test_eval.py). Every rank of the model runs every
request (model parallelism, not lm-eval's data parallelism): the LM reports rank 0 of a world of
one to lm-eval.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix, resolve_max_length

from toolkit.infer.engine import Generator, Sampling

PAD_TO = 8  # sequence lengths padded to a multiple of this (tp with SP, cp's 2 x cp chunks)


class ShardedLM(TemplateLM):
    """``chunks``: this rank's model; ``tokenizer``: the HF tokenizer; ``hf_config``: the
    model's transformers config (its context length); ``generator``: for ``generate_until``."""

    def __init__(self, chunks: Sequence[torch.nn.Module], tokenizer: Any, hf_config: Any, *,
                 vocab_size: int, generator: Generator | None = None, batch_size: int = 8,
                 max_length: int | None = None, add_bos_token: bool | None = None):
        super().__init__()
        self.chunks, self.tokenizer, self.vocab_size = list(chunks), tokenizer, vocab_size
        self.generator, self._batch_size, self.add_bos_token = generator, batch_size, add_bos_token
        self._max_length = max_length or resolve_max_length(hf_config, tokenizer)

    # -- what lm-eval asks of a model ----------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(
                string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # -- scores ---------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it),
        per (key, context tokens, continuation tokens), the input cut as lm-eval's hf model
        cuts it (the last ``max_length`` tokens before the final one)."""
        out: list[tuple[float, bool]] = []
        size = override_bs or self._batch_size
        for start in range(0, len(requests), size):
            batch = requests[start:start + size]
            inputs = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in batch]
            logprobs = self._log_softmax(inputs)
            for (key, _, cont), inp, lp in zip(batch, inputs, logprobs, strict=True):
                tail = lp[len(inp) - len(cont):len(inp)]
                target = torch.tensor(cont)
                greedy = bool((tail.argmax(dim=-1) == target).all())
                score = float(tail.gather(1, target.unsqueeze(1)).sum())
                out.append((score, greedy))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, (score, greedy))
        return out

    def _log_softmax(self, inputs: list[list[int]]) -> torch.Tensor:
        """Log-probabilities [batch, length, vocab] (fp32) of right-padded ``inputs``."""
        from toolkit.adapters.live import forward_logits

        width = max(len(x) for x in inputs)
        width += -width % PAD_TO
        tokens = torch.zeros(len(inputs), width, dtype=torch.long)
        for i, x in enumerate(inputs):
            tokens[i, :len(x)] = torch.tensor(x)
        with torch.no_grad():
            logits = forward_logits(self.chunks, tokens, self.vocab_size)
        return F.log_softmax(logits.float().cpu(), dim=-1)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Perplexity tasks: each text in lm-eval's rolling windows of the context length."""
        out = []
        for (text,) in (r.args for r in requests):
            windows = [(None, *lm_utils.make_disjoint_window(w))
                       for w in lm_utils.get_rolling_token_windows(
                           token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                           max_seq_len=self.max_length, context_len=1)]
            total = sum(score for score, _ in self._loglikelihood_tokens(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, ``do_sample``) completions cut at the first stop string."""
        if self.generator is None:
            raise RuntimeError("this evaluation was set up without a generator")
        out = []
        for context, kwargs in (r.args for r in requests):
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.pop("max_gen_toks", 256))
            sampled = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if sampled else 0.0
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - new)
            (done,) = self.generator.generate([prompt], Sampling(
                max_new_tokens=new, temperature=temperature))
            text = self.tok_decode(done.completion_ids)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, {"until": until}), text)
            out.append(text)
        return out
