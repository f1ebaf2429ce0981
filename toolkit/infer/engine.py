"""Token generation on this rank's model chunks with megatron-core's own inference machinery.

megatron-core 0.16.1's ``StaticInferenceEngine`` builds its dynamic engine first (CUDA graphs,
CUDA-only buffers) and falls back to the legacy static batch; mdtk asks for the legacy path
directly (``legacy=True``): ``TextGenerationController.generate_all_output_tokens_static_batch``
with a ``StaticInferenceContext`` KV cache, which runs on CUDA and, with mdtk's CPU redirects,
on gloo ranks too. It is what "static batching" means in Megatron: prompts of different lengths
in one batch are prefilled to the shortest length, then every decode step appends one token
(the prompt's own where a prompt is longer). Tensor parallelism gathers the logits, pipeline
parallelism broadcasts each step's tokens from the last stage, so every rank returns the same
completions. Sampling draws from the controller's own generator, seeded per call, identically
on every rank (the same tokens at any layout when the logits agree).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from toolkit.errors import UserError
from toolkit.models.vocab import mask_vocab_padding


class GenerationError(UserError):
    """A generation request the engine cannot serve (length, sampling settings)."""


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: temperature 0 is greedy; ``top_k`` / ``top_p`` 0 / 1.0 are off
    (megatron-core takes at most one of them)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 1234

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
        if self.temperature < 0:
            raise GenerationError(f"temperature={self.temperature} must be >= 0 (0: greedy).")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p={self.top_p} must be in (0, 1] (1: off).")
        if self.top_k < 0:
            raise GenerationError(f"top_k={self.top_k} must be >= 0 (0: off).")
        if self.top_k > 0 and self.top_p < 1.0:
            raise GenerationError(f"top_k={self.top_k} with top_p={self.top_p}: megatron-core "
                                  "samples with one of them; set the other off (top_k 0 or "
                                  "top_p 1.0).")


@dataclass(frozen=True)
class Completion:
    """One prompt's generation: the tokens after the prompt (the end-of-sequence token
    included when one ended it, as ``transformers.generate`` returns it) and why it ended."""

    completion_ids: list[int]
    finish_reason: str  # "eos" | "length"
    logprobs: list[float] | None = None  # of the sampled tokens (at the sampling temperature)


class _Tokens:
    """What megatron-core's controller asks of a tokenizer: the end-of-sequence id, and text
    for its (unused) detokenized output."""

    def __init__(self, eod: int, decode: Any):
        self.eod, self.bos, self._decode = eod, None, decode

    def tokenize(self, text: str) -> list[int]:
        raise GenerationError("prompts reach the engine as token ids")

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._decode(list(ids)) if self._decode is not None else ""


def _controller(base: type) -> type:
    """megatron-core's controller sampling from the real vocabulary only: its sampler draws
    one exponential per column (torch.multinomial), so the columns tensor parallelism pads the
    vocabulary with would change every draw even at probability 0."""

    class Controller(base):
        real_vocab: int

        def sample_from_logits(self, last_token_logits: torch.Tensor, *args: Any,
                               **kwargs: Any) -> torch.Tensor:
            return super().sample_from_logits(last_token_logits[..., :self.real_vocab],
                                              *args, **kwargs)

    return Controller


def _scaling(base: type) -> type:
    """megatron-core's model wrapper with its logits divided by the sampling temperature: the
    controller then samples at temperature 1 from the same distribution and returns the
    log-probabilities of that distribution (its own are of the unscaled logits), which is what
    an RL trainer compares with its own (TRL's are at the sampling temperature)."""

    class Wrapper(base):
        logit_scale = 1.0
        chunks: Sequence[torch.nn.Module] = ()  # virtual pipeline stages: all of this rank's

        def run_one_forward_step(self, *args: Any, **kwargs: Any) -> Any:
            out = super().run_one_forward_step(*args, **kwargs)
            if self.logit_scale != 1.0 and isinstance(out, torch.Tensor):
                out = out * self.logit_scale
            return out

        def forward_pass_with_pipeline_parallel_small_input_batch(
                self, inference_input: dict[str, Any], recv_buffer_seq_len: int | None = None,
        ) -> torch.Tensor | None:
            if len(self.chunks) < 2:
                return super().forward_pass_with_pipeline_parallel_small_input_batch(
                    inference_input, recv_buffer_seq_len)
            return _around_the_ring(self, inference_input, recv_buffer_seq_len)

    return Wrapper


def _around_the_ring(wrapper: Any, inputs: dict[str, Any], seq_len: int | None) -> Any:
    """One forward step with virtual pipeline stages: the batch goes around the pipeline ring
    once per chunk (chunk v of every rank in turn, the layer order of training's interleaved
    schedule); megatron-core's static engine knows one chunk per rank. The logits (last rank)."""
    from megatron.core.inference.communication_utils import (
        recv_from_prev_pipeline_rank_,
        send_to_next_pipeline_rank,
    )

    group = wrapper.pp_group
    batch, seq = wrapper._get_batch_size_and_seq_len(inputs["tokens"], seq_len)
    first, last = group.rank() == 0, group.rank() == group.size() - 1
    out = None
    for v, chunk in enumerate(wrapper.chunks):
        received = None
        if not (first and v == 0):
            received = wrapper._allocate_recv_buffer(batch, seq)
            recv_from_prev_pipeline_rank_(received, group)
        chunk.set_input_tensor(received)
        out = chunk(inputs["tokens"], inputs["position_ids"], inputs["attention_mask"],
                    inference_context=wrapper.inference_context, runtime_gather_output=True)
        if not (last and v == len(wrapper.chunks) - 1):
            send_to_next_pipeline_rank(out.type(dtype=wrapper.pipeline_communication_dtype),
                                       group)
    wrapper.inference_context.increment_sequence_len_offset(seq)
    return out.to(wrapper.inference_wrapper_config.params_dtype) if last else None


@contextmanager
def _sequence_parallel_off(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """A training model's sequence parallelism switched off while it generates (megatron-core's
    static batch refuses it: one decode token cannot be split over the tp ranks) and back on
    after; the weights are the same, only the communication pattern changes. Every chunk at
    once: virtual pipeline stages share one config."""
    if not getattr(chunks[0].config, "sequence_parallel", False):
        yield
        return
    from megatron.core.transformer.utils import set_model_to_sequence_parallel

    for chunk in chunks:
        set_model_to_sequence_parallel(chunk, False)
    try:
        yield
    finally:
        for chunk in chunks:
            set_model_to_sequence_parallel(chunk, True)


@contextmanager
def _grad_free_not_inference(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """megatron-core's inference code runs in ``torch.inference_mode``: tensors made there can
    never join autograd later. A ZeRO-3 model gathers its partitions during the forward, and
    DeepSpeed keeps some of what it gathered for the next (training) forward, which then fails
    ("Inference tensors cannot be saved for backward"). For such a model the inference regions
    run as ``torch.no_grad`` instead (the same numbers, no gradients)."""
    if not any(hasattr(p, "ds_id") for chunk in chunks for p in chunk.parameters()):
        yield
        return
    cls = torch.inference_mode
    saved = cls.__enter__, cls.__exit__

    def enter(self: Any) -> None:
        self._mdtk_no_grad = torch.no_grad()
        self._mdtk_no_grad.__enter__()

    def leave(self: Any, *exc: Any) -> None:
        self._mdtk_no_grad.__exit__(*exc)

    cls.__enter__, cls.__exit__ = enter, leave
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = saved


@contextmanager
def megatron_quiet() -> Iterator[None]:
    """megatron-core's notes that do not apply here, on every call and rank: the static
    engine's deprecation, and CUDA_DEVICE_MAX_CONNECTIONS (an overlap hint for training)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The static engine will be deprecated")
        warnings.filterwarnings("ignore", "When using async grad allreduce")
        yield


class Generator:
    """Generation on ``chunks`` (this rank's GPTModels: one, or one per virtual pipeline stage).
    ``eos_ids``: the tokens that end a completion (the first is megatron-core's termination
    id; a completion is cut after the first of any). ``vocab_size``: the real vocabulary (the
    rows tensor parallelism pads it with get -inf logits, so sampling never draws them and
    draws alike at every tp). ``max_seq_len``: prompt + completion tokens the KV cache holds;
    ``max_batch``: prompts per static batch."""

    def __init__(self, chunks: Sequence[torch.nn.Module], *, eos_ids: Sequence[int],
                 vocab_size: int, max_seq_len: int, max_batch: int = 8, decode: Any = None):
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.inference.engines.static_engine import StaticInferenceEngine
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
            GPTInferenceWrapper,
        )
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig,
        )
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # noqa: E501
            TextGenerationController,
        )

        if not eos_ids:
            raise GenerationError("the model names no end-of-sequence token (eos_token_id in "
                                  "its config.json or generation_config.json).")
        model = chunks[0]
        self.model, self.chunks = model, list(chunks)
        model.eval()
        mask_vocab_padding(chunks, vocab_size)
        config = model.config
        self.eos_ids, self.max_seq_len, self.max_batch = list(eos_ids), max_seq_len, max_batch
        wrapper_config = InferenceWrapperConfig(
            hidden_size=config.hidden_size, params_dtype=config.params_dtype,
            inference_batch_times_seqlen_threshold=-1, padded_vocab_size=model.vocab_size,
            inference_max_requests=max_batch, inference_max_seq_length=max_seq_len)
        wrapped = _scaling(GPTInferenceWrapper)(model, wrapper_config,
                                                StaticInferenceContext(max_batch, max_seq_len))
        wrapped.chunks = self.chunks
        self.wrapped = wrapped
        self.controller = _controller(TextGenerationController)(
            wrapped, _Tokens(self.eos_ids[0], decode))
        self.controller.real_vocab = vocab_size
        with megatron_quiet():
            self.engine = StaticInferenceEngine(self.controller, max_batch_size=max_batch,
                                                legacy=True)
        self._next_id = 0

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, *,
                 logprobs: bool = False) -> list[Completion]:
        """The completions of ``prompts`` (token ids), in order."""
        from megatron.core.inference.inference_request import InferenceRequest
        from megatron.core.inference.sampling_params import SamplingParams

        sampling.check()
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise GenerationError(f"prompt {i} is empty.")
            if len(prompt) + sampling.max_new_tokens > self.max_seq_len:
                raise GenerationError(
                    f"prompt {i} has {len(prompt)} tokens: with max_new_tokens="
                    f"{sampling.max_new_tokens} it needs {len(prompt) + sampling.max_new_tokens}"
                    f" positions, the model takes {self.max_seq_len}. Shorten the prompt or "
                    "lower max_new_tokens.")
        greedy = sampling.temperature == 0.0
        # with log-probabilities: the logits scaled here, so they are the sampled distribution's
        scaled = logprobs and not greedy and sampling.temperature != 1.0
        self.wrapped.logit_scale = 1.0 / sampling.temperature if scaled else 1.0
        params = SamplingParams(
            temperature=1.0 if greedy or scaled else float(sampling.temperature),
            top_k=1 if greedy else int(sampling.top_k),
            top_p=0.0 if greedy or sampling.top_p >= 1.0 else float(sampling.top_p),
            num_tokens_to_generate=sampling.max_new_tokens, return_log_probs=logprobs,
            skip_prompt_log_probs=True)
        if logprobs:  # megatron-core leaves its termination token (and its log-prob) out: go
            params.add_attributes({"no_early_termination": True})  # on, cut it here
        self.controller.sampling_rng.manual_seed(sampling.seed)
        requests = []
        for prompt in prompts:
            requests.append(InferenceRequest(request_id=self._next_id, prompt="",
                                             prompt_tokens=list(prompt), sampling_params=params))
            self._next_id += 1
        for chunk in self.chunks:  # megatron-core puts the first in eval mode, not the others
            chunk.eval()
        with megatron_quiet(), _sequence_parallel_off(self.chunks), \
                _grad_free_not_inference(self.chunks):
            done = self.engine.generate(inference_requests=requests)
        return [self._completion(r, sampling.max_new_tokens, logprobs) for r in done]

    def _completion(self, request: Any, limit: int, logprobs: bool) -> Completion:
        tokens = request.generated_tokens
        ids = [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]
        ids = ids[:limit]
        end = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
        reason = "length"
        if end is not None:
            ids, reason = ids[:end + 1], "eos"
        elif len(ids) < limit:  # megatron-core stopped at its termination id and left it out
            ids, reason = [*ids, self.eos_ids[0]], "eos"
        probs = None
        if logprobs and request.generated_log_probs is not None:
            values = request.generated_log_probs
            probs = [float(x) for x in (values.tolist() if hasattr(values, "tolist")
                                        else values)][:len(ids)]
        return Completion(completion_ids=ids, finish_reason=reason, logprobs=probs)
