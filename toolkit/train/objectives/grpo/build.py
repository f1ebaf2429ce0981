"""The run's GRPO objective from its config: the rollout source (recorded, or the generation
engine on the live policy), the reward functions, the reference (``beta != 0``: the starting
model frozen, or with LoRA the policy with its adapters off) and the loss."""

from __future__ import annotations

from typing import Any

from toolkit.errors import ConfigError
from toolkit.train.objectives.grpo import rewards as rw
from toolkit.train.objectives.grpo.loss import GrpoLoss
from toolkit.train.objectives.grpo.objective import GrpoObjective, Rows
from toolkit.train.objectives.grpo.rollouts import Generated, Recorded
from toolkit.train.objectives.grpo.spec import (
    BATCH_METRICS,
    EXTREMES,
    corrects_sampling,
    metric_names,
    reward_function,
)
from toolkit.train.objectives.sampling import policy_eos_ids


def grpo_objective(s: Any) -> GrpoObjective:
    cfg, g, data = s.cfg, s.cfg.grpo, s.data
    if s.global_batch % g.num_generations:
        raise ConfigError(f"the global batch of {s.global_batch} completions is not a multiple "
                          f"of grpo.num_generations={g.num_generations}: set train.global_batch "
                          "to prompts per step x num_generations.")
    tok = data.tokenizer
    ends = set(policy_eos_ids(s.policy, tok)) | ({tok.pad_token_id} - {None})
    if data.groups is not None:
        source: Any = Recorded(data.groups, ends)
    else:
        source = _generated(s, data, [rw.RewardFn(*reward_function(r)) for r in g.rewards])
    sampled = data.groups is None or data.groups[0].logprobs is not None
    names = metric_names(cfg, list(source.names), sampled)
    batch_names = tuple(n for n in names if n in BATCH_METRICS or n in EXTREMES
                        or n.startswith("rewards/"))
    loss = GrpoLoss(g.loss_type, s.policy.shape.vocab, names, batch_names,
                    temperature=g.temperature or 1.0, beta=g.beta, epsilon=g.epsilon,
                    epsilon_high=g.epsilon if g.epsilon_high is None else g.epsilon_high,
                    sequence_level=g.importance_sampling_level == "sequence",
                    max_completion_length=g.max_completion_length,
                    bias_correction_kl=g.use_bias_correction_kl)
    reference = None
    if g.beta != 0.0:
        from toolkit.train.objectives.dpo.objective import reference_model

        reference = reference_model(cfg, s.layout, s.mpu, s.ds_config, s.policy, s.chunks, None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return GrpoObjective(loss, source, global_batch=s.global_batch, group=g.num_generations,
                         num_iterations=g.num_iterations, scale_rewards=g.scale_rewards,
                         rows=Rows(cfg.train.seq_len, int(pad), g.mask_truncated_completions),
                         policy=s.chunks, reference=reference,
                         correction=(g.vllm_importance_sampling_mode,
                                     g.vllm_importance_sampling_clip_min,
                                     g.vllm_importance_sampling_clip_max)
                         if corrects_sampling(cfg, sampled) else None)


def _generated(s: Any, data: Any, fns: list[rw.RewardFn]) -> Generated:
    """Rollouts sampled by the generation engine on the policy's live chunks."""
    from toolkit.infer.engine import Sampling
    from toolkit.train.objectives.sampling import live_generator

    cfg, g = s.cfg, s.cfg.grpo
    every_row = s.layout.ep > 1  # the experts' all-to-all spans data-parallel ranks
    rows = s.global_batch if every_row else s.global_batch // s.layout.dp
    eos = policy_eos_ids(s.policy, data.tokenizer)
    if g.engine == "vllm":
        from toolkit.infer.vllm_engine import VllmSampler
        from toolkit.train.model import DTYPES

        sampler: Any = VllmSampler(s.chunks, s.adapter, dtype=DTYPES[cfg.train.precision],
                                   max_model_len=cfg.train.seq_len + 1, max_batch=rows,
                                   eos_ids=eos, seed=cfg.train.seed, every_row=every_row,
                                   gpu_memory_utilization=g.vllm_gpu_memory_utilization,
                                   tensor_parallel_size=g.vllm_tensor_parallel_size)
    else:
        sampler = live_generator(s, rows, eos)
    sampling = Sampling(max_new_tokens=g.max_completion_length, temperature=g.temperature,
                        top_p=g.top_p, top_k=g.top_k, seed=cfg.train.seed)
    return Generated(data.prompts, g.num_generations, fns, sampler, sampling, data.tokenizer,
                     shuffle=cfg.data.shuffle, seed=cfg.train.seed, every_row=every_row)
