"""What the ``grpo`` section may say (torch-free: read by the config checks), checked before
anything runs: the section against ``data.mode`` and itself, the reward functions (imported
here, so a typo fails before any model is built), the batch against ``num_generations``."""

from __future__ import annotations

from typing import Any

from toolkit.errors import ConfigError

#: TRL's clip-ratio metrics (cispo reports its own)
CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
#: the metrics of a generation batch (the same at every step that trains on it)
BATCH_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                 "completions/min_length", "completions/max_length",
                 "completions/clipped_ratio")
GAP = "sampling/sampling_logp_difference/mean"  # the engine's log-probs vs the trainer's
RECORDED = "recorded"  # the reward function name of recorded rewards

IS_RATIO = "sampling/importance_sampling_ratio/mean"  # TRL's vLLM sampling correction
#: the correction's extremes over the generation batch (max |gap|, max and min ratio): TRL's
EXTREMES = ("sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/max",
            "sampling/importance_sampling_ratio/min")
#: TRL's vllm_importance_sampling_mode values (``loss.sampling_ratio``)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def corrects_sampling(cfg: Any, sampled: bool) -> bool:
    """Whether the loss takes TRL's importance-sampling correction for the sampler's mismatch
    (``vllm_importance_sampling_correction``): rollouts from vLLM, or recorded with the
    sampler's log-probabilities (as TRL's ``rollout_func`` returns them with vLLM). mdtk's own
    engine samples with the trainer's numerics: no correction, as TRL without vLLM."""
    g = cfg.grpo
    if not g.vllm_importance_sampling_correction:
        return False
    return sampled if g.rollouts else g.engine == "vllm"


def metric_names(cfg: Any, reward_names: list[str], sampled: bool) -> tuple[str, ...]:
    """TRL's metric names of a run, in order: the loss's, then the generation batch's.
    ``sampled``: the rollouts carry the sampler's log-probabilities (generated ones do)."""
    g = cfg.grpo
    names = ["kl"] if g.beta != 0 else []
    names += ["entropy", *(("cispo_clip_ratio",) if g.loss_type == "cispo" else CLIP_METRICS)]
    if sampled:
        names.append(GAP)
    if corrects_sampling(cfg, sampled):
        names += [IS_RATIO, *EXTREMES]
    names += list(BATCH_METRICS)
    for n in reward_names:
        names += [f"rewards/{n}/mean", f"rewards/{n}/std"]
    return tuple(names)


def check_grpo(cfg: Any, default: Any) -> None:
    """The section set for another mode is refused; a grpo run's settings checked together."""
    g = cfg.grpo
    changed = [k for k in vars(default) if getattr(g, k) != getattr(default, k)]
    if cfg.data.mode != "grpo":
        if changed:
            raise ConfigError(f"grpo.{changed[0]} applies to data.mode=grpo; got data.mode="
                              f"{cfg.data.mode}: remove it or set data.mode=grpo.")
        return
    if cfg.model.config:
        raise ConfigError("data.mode=grpo tunes a trained model: set model.path (the policy and, "
                          "frozen, the reference) instead of model.config.")
    if g.engine == "vllm":
        check_vllm(cfg)
    check_sampling_correction(g)
    if g.rollouts and g.rewards:
        raise ConfigError("grpo.rollouts gives each completion its reward: remove grpo.rewards "
                          "(or grpo.rollouts, to generate and score completions).")
    if not g.rollouts and not g.rewards:
        raise ConfigError("data.mode=grpo needs grpo.rewards (reward functions, e.g. {function: "
                          "'my_rewards:accuracy'}) or grpo.rollouts (recorded rollouts with "
                          "rewards).")
    if not g.rollouts and g.temperature == 0:
        raise ConfigError("grpo.temperature=0 samples greedily: every completion of a group is "
                          "the same and their advantages are 0; use a temperature > 0 (TRL's "
                          "default is 1.0).")
    if g.top_p <= 0 or g.top_p > 1:
        raise ConfigError(f"grpo.top_p={g.top_p} must be in (0, 1].")
    if g.loss_type == "cispo" and g.epsilon_high is None:
        raise ConfigError("grpo.loss_type=cispo clips the ratio at grpo.epsilon_high alone: set "
                          "it (the CISPO paper uses 5.0 with epsilon 0.2's role gone).")
    if g.importance_sampling_level == "sequence" and g.loss_type == "cispo":
        raise ConfigError("grpo.importance_sampling_level=sequence with loss_type=cispo: "
                          "choose token-level ratios for cispo, or a clipped loss for GSPO.")
    if cfg.parallel.cp > 1:
        raise ConfigError(f"data.mode=grpo with parallel.cp={cfg.parallel.cp}: its per-sequence "
                          "terms (means, GSPO's ratio) need whole rows on a rank; set "
                          "parallel.cp=1.")
    if cfg.data.pack:
        raise ConfigError("data.pack with data.mode=grpo: a completion row is one prompt and one "
                          "completion; remove data.pack.")
    batch = cfg.train.global_batch
    if batch is not None and batch % g.num_generations:
        raise ConfigError(f"train.global_batch={batch} counts completions: it must be a multiple "
                          f"of grpo.num_generations={g.num_generations} (prompts per step x "
                          "num_generations).")
    if g.num_generations < 2 and not g.rollouts:
        raise ConfigError("grpo.num_generations=1: a group of one has no baseline (its "
                          "advantage is 0); use at least 2.")
    for spec in g.rewards:
        reward_function(spec)  # imported now: a missing module fails before any model


def check_sampling_correction(g: Any) -> None:
    """TRL's ``vllm_importance_sampling_*`` settings, checked together."""
    lo, hi = g.vllm_importance_sampling_clip_min, g.vllm_importance_sampling_clip_max
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(f"grpo.vllm_importance_sampling_clip_min={lo} is above "
                          f"vllm_importance_sampling_clip_max={hi}: the kept ratios are "
                          "[clip_min, clip_max].")
    if g.vllm_importance_sampling_mode.endswith("truncate") and hi is None and lo is None:
        raise ConfigError(f"grpo.vllm_importance_sampling_mode="
                          f"{g.vllm_importance_sampling_mode} needs vllm_importance_sampling_"
                          "clip_max (or clip_min): the bound it truncates the ratios at.")


def check_vllm(cfg: Any) -> None:
    """What a colocated vLLM engine cannot do, before any model is built."""
    from toolkit.infer.vllm_engine import vllm_missing

    g = cfg.grpo
    if g.rollouts:
        raise ConfigError("grpo.engine=vllm samples completions, grpo.rollouts replays recorded "
                          "ones: remove one of them.")
    if not 0 < g.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"grpo.vllm_gpu_memory_utilization={g.vllm_gpu_memory_utilization} "
                          "must be in (0, 1] (TRL's default is 0.3).")
    problem = vllm_missing()
    if problem:
        raise ConfigError(f"grpo.engine=vllm: {problem}; or use grpo.engine=megatron (the "
                          "training ranks generate).")


def reward_function(spec: Any) -> tuple[str, Any, float]:
    """(name, callable, weight) of one ``grpo.rewards`` entry: ``function`` is
    "module:attribute" (imported) or "mdtk:name" (``rewards.BUILTIN``); ``args`` are bound."""
    import functools
    import importlib

    if not isinstance(spec, dict) or not isinstance(spec.get("function"), str):
        raise ConfigError(f"grpo.rewards entry {spec!r}: each is {{function: 'module:name', "
                          "weight: 1.0, args: {...}}.")
    unknown = set(spec) - {"function", "weight", "args"}
    if unknown:
        raise ConfigError(f"grpo.rewards entry {spec['function']!r}: unknown key "
                          f"{sorted(unknown)[0]!r} (function, weight, args).")
    target, weight, args = spec["function"], spec.get("weight", 1.0), spec.get("args") or {}
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ConfigError(f"grpo.rewards {target!r}: weight={weight!r} must be a number.")
    module, _, name = target.partition(":")
    if not module or not name:
        raise ConfigError(f"grpo.rewards function={target!r}: write 'module:function' (a module "
                          "on PYTHONPATH or beside the config) or 'mdtk:<builtin>'.")
    if module == "mdtk":
        from toolkit.train.objectives.grpo.builtin import BUILTIN

        if name not in BUILTIN:
            raise ConfigError(f"grpo.rewards function={target!r}: mdtk has "
                              f"{', '.join(sorted(BUILTIN))}.")
        fn = BUILTIN[name]
    else:
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"grpo.rewards function={target!r} cannot be imported ({e}): put "
                              f"{module}.py on PYTHONPATH (or in the working directory).") from None
    if not callable(fn):
        raise ConfigError(f"grpo.rewards function={target!r} is not callable.")
    if args:
        if not isinstance(args, dict):
            raise ConfigError(f"grpo.rewards {target!r}: args must be a mapping.")
        fn = functools.partial(fn, **args)
    return name, fn, float(weight)
