"""The objective of a run's ``data.mode``: ``BUILDERS`` maps each mode to its builder, called
once the policy exists; ``before_policy`` computes what an objective needs before it (DPO's
precomputed reference). A new objective is a module beside this one and its line here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toolkit.train.objectives.base import Objective

__all__ = ["BUILDERS", "Objective", "ObjectiveSetup", "before_policy", "objective_data",
           "objective_for"]


@dataclass(frozen=True)
class ObjectiveSetup:
    """What an objective is built from, once the policy exists."""

    cfg: Any  # TrainConfig
    layout: Any  # the run's ResolvedLayout
    mpu: Any
    ds_config: dict[str, Any]
    policy: Any  # the run's ModelSpec
    chunks: list[Any]  # this rank's policy chunks
    global_batch: int
    precomputed: Any = None  # DPO: the reference log-probabilities computed before the policy
    data: Any = None  # the run's prepared data (GRPO: its prompts or recorded rollouts)
    adapter: Any = None  # the policy's Adapter (GRPO's vLLM engine streams its weights)


def _plain(s: ObjectiveSetup) -> Objective:
    return Objective()


def _dpo(s: ObjectiveSetup) -> Objective:
    from toolkit.train.objectives.dpo.objective import dpo_objective

    return dpo_objective(s.cfg, s.layout, s.mpu, s.ds_config, s.policy, s.precomputed,
                         s.chunks)


def _reward(s: ObjectiveSetup) -> Objective:
    from toolkit.train.objectives.reward import RewardLoss, RewardObjective

    return RewardObjective(RewardLoss(s.cfg.reward.center_rewards_coefficient))


def _kto(s: ObjectiveSetup) -> Objective:
    from toolkit.errors import ConfigError
    from toolkit.train.objectives.dpo.objective import reference_model
    from toolkit.train.objectives.kto import KtoLoss, KtoObjective

    if s.global_batch < 2:
        raise ConfigError(f"data.mode=kto with a global batch of {s.global_batch}: its KL term "
                          "pairs a prompt with another sample's completion of the same batch "
                          "(TRL requires a batch > 1); set train.global_batch >= 2.")
    k = s.cfg.kto
    reference = reference_model(s.cfg, s.layout, s.mpu, s.ds_config, s.policy, s.chunks,
                                None)  # the starting model
    return KtoObjective(KtoLoss(k.beta, k.desirable_weight, k.undesirable_weight), reference,
                        s.chunks, s.global_batch)


def _distill(s: ObjectiveSetup) -> Objective:
    from toolkit.train.objectives.distill import DistillObjective, GkdLoss

    model = _teacher(s)
    on_policy = _on_policy(s) if s.cfg.distill.lmbda > 0 else None
    return DistillObjective(GkdLoss(s.cfg.distill.beta, s.policy.shape.vocab), model, on_policy)


def _teacher(s: ObjectiveSetup) -> Any:
    """The distillation teacher, frozen at the student's layout: an HF folder or hub id, or
    an mdtk / Megatron checkpoint of any layout (resharded on load), in ``distill.teacher_dtype``
    (auto: the run's precision)."""
    from toolkit.adapters import live
    from toolkit.adapters.spec import ModelSpec, has_config
    from toolkit.errors import ConfigError
    from toolkit.train.model import DTYPES
    from toolkit.train.objectives.dpo.objective import frozen_chunks, frozen_model

    d, label = s.cfg.distill, "distillation teacher"
    dtype = DTYPES[s.cfg.train.precision if d.teacher_dtype == "auto" else d.teacher_dtype]
    path = live.resolve_source(d.teacher)
    if has_config(str(path)):
        teacher = ModelSpec.of(path, live=True, name="teacher")
        return frozen_model(s.cfg, s.layout, s.mpu, s.ds_config, teacher, label, dtype)
    from toolkit.infer.load import load  # a checkpoint of any layout, read at this one

    loaded = load(str(path), s.layout, dtype=dtype, tokenizer=s.cfg.tokenizer_path)
    if loaded.spec.shape.vocab != s.policy.shape.vocab:
        raise ConfigError(f"distill.teacher={d.teacher!r} has a vocabulary of "
                          f"{loaded.spec.shape.vocab} tokens, the student "
                          f"{s.policy.shape.vocab}: teacher and student must share the "
                          "tokenizer.")
    return frozen_chunks(s.cfg, s.mpu, s.ds_config, loaded.chunks, loaded.adapter.dims.vocab,
                         label)


def _on_policy(s: ObjectiveSetup) -> Any:
    """GKD's on-policy completions, sampled by the student on the training ranks."""
    from toolkit.infer.engine import Sampling
    from toolkit.train.data import load_tokenizer
    from toolkit.train.objectives.onpolicy import OnPolicy
    from toolkit.train.objectives.sampling import live_generator, policy_eos_ids

    d, tok = s.cfg.distill, load_tokenizer(s.cfg.tokenizer_path)
    rows = s.global_batch // s.layout.dp
    sampler = live_generator(s, rows, policy_eos_ids(s.policy, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return OnPolicy(sampler, Sampling(max_new_tokens=d.max_new_tokens, temperature=d.temperature,
                                      seed=s.cfg.train.seed),
                    d.lmbda, s.cfg.train.seed, s.cfg.train.seq_len, int(pad))


def _grpo(s: ObjectiveSetup) -> Objective:
    from toolkit.train.objectives.grpo.build import grpo_objective

    return grpo_objective(s)


#: data.mode -> the objective's builder
BUILDERS: dict[str, Callable[[ObjectiveSetup], Objective]] = {
    "pretrain": _plain, "sft": _plain, "dpo": _dpo, "reward": _reward, "kto": _kto,
    "distill": _distill, "grpo": _grpo,
}


def objective_for(setup: ObjectiveSetup) -> Objective:
    """The run's objective (``data.mode``), built after the policy."""
    return BUILDERS[setup.cfg.data.mode](setup)


def objective_data(cfg: Any) -> Any:
    """The data of a mode that does not read tokenised samples (GRPO: prompts or recorded
    rollouts, ``data.grpo``), or None: the samples ``data.prepare_data_distributed`` makes."""
    if cfg.data.mode != "grpo":
        return None
    from toolkit.train.data import DataSettings
    from toolkit.train.data.grpo import prepare

    data = prepare(DataSettings.from_config(cfg), cfg.tokenizer_path, cfg.grpo,
                   cfg.train.seq_len)
    if cfg.grpo.rewards:
        from toolkit.train.objectives.grpo import rewards
        from toolkit.train.objectives.grpo.spec import reward_function

        rewards.probe([rewards.RewardFn(*reward_function(r)) for r in cfg.grpo.rewards],
                      data.prompts)
    return data


def before_policy(cfg: Any, layout: Any, mpu: Any, ds_config: dict[str, Any], data: Any,
                  micro_batch: int, dp_rank: int, policy: Any) -> Any:
    """What an objective computes before the policy is built (collective), for its
    ``ObjectiveSetup.precomputed``: DPO's reference log-probabilities of every pair when
    ``dpo.precompute_reference`` asks for them; else None."""
    if cfg.data.mode != "dpo" or not cfg.dpo.precompute_reference:
        return None
    from toolkit.train.objectives.dpo.objective import precomputed_reference

    return precomputed_reference(cfg, layout, mpu, ds_config, data, micro_batch, dp_rank,
                                 policy)
