"""Rank functions for the GRPO checks (``toolkit.train.trainer.run`` with ``data.mode: grpo``).

Recorded rollouts (``make_rollouts``): 6 prompts of the bundled SFT rows, 4 completions each
(random token ids of random lengths, most ending with the EOS token, some truncated; random
rewards with one tied group), so 3 generation batches of 2 prompts x 4 completions. The same
rows go to TRL's GRPOTrainer through its ``rollout_func`` (tests/test_trainer_grpo.py).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEPS, GROUP, PROMPTS, SEQ, LR = 3, 4, 2, 48, 1e-3
GLOBAL = GROUP * PROMPTS
#: the TRL-compared runs: name -> the grpo settings (TRL's names)
RUNS: dict[str, dict[str, Any]] = {
    "dapo": {"loss_type": "dapo"},
    "grpo_kl_it2": {"loss_type": "grpo", "beta": 0.04, "num_iterations": 2, "temperature": 0.7},
    "dr_grpo_batch": {"loss_type": "dr_grpo", "scale_rewards": "batch", "num_iterations": 2,
                      "max_completion_length": 12},
    "bnpo_kl": {"loss_type": "bnpo", "beta": 0.04, "num_iterations": 2, "epsilon": 0.1,
                "scale_rewards": "none"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.02, "num_iterations": 2},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04,
             "num_iterations": 2, "mask_truncated_completions": True, "epsilon": 3e-4,
             "epsilon_high": 4e-4},
}


@dataclass(frozen=True)
class GrpoCase:
    run: str  # a RUNS entry
    name: str = ""
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    sp: bool = False
    zero: int = 1
    micro: int = GLOBAL
    model: str = "dense"
    overrides: tuple[str, ...] = field(default=())

    @property
    def label(self) -> str:
        return self.name or self.run


def make_rollouts(root: Path, tokenizer_path: str) -> dict[str, str]:
    """The recorded rollouts file and the prompts file (in the test process)."""
    from toolkit import bundled
    from toolkit.train.data import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    rows = [json.loads(x) for x in
            bundled.path("bundled:examples/data/dpo_text.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] for r in rows if isinstance(r.get("prompt"), str)][:PROMPTS * STEPS]
    rnd = random.Random(7)
    out = []
    for p, prompt in enumerate(prompts):
        for k in range(GROUP):
            n = rnd.randint(3, 10)
            ids = [rnd.randint(5, len(tok) - 1) for _ in range(n)]
            if (p + k) % 3:
                ids[-1] = tok.eos_token_id  # ended; else truncated
            reward = 0.5 if p == 1 else round(rnd.uniform(-1, 2), 3)  # group 1: zero std
            out.append({"prompt": prompt, "completion_ids": ids, "reward": reward})
    path = root / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    prompts_path = root / "prompts.jsonl"
    prompts_path.write_text("".join(json.dumps({"prompt": p, "answer": "4"}) + "\n"
                                    for p in prompts))
    return {"rollouts": str(path), "prompts": str(prompts_path)}


def with_logprobs(assets: dict[str, str], noise: float = 0.3, seed: int = 3) -> dict[str, str]:
    """``assets`` with its recorded rollouts given a ``logprobs`` column (in the test process):
    the starting policy's log-probability of each completion token (transformers, fp32) plus
    N(0, ``noise``), as a sampler with other numerics gives them, so TRL's correction ratios
    spread over both sides of their bounds."""
    import torch
    import transformers as tf

    from toolkit.train.data import load_tokenizer

    tok = load_tokenizer(assets["tokenizer"])
    model = tf.AutoModelForCausalLM.from_pretrained(assets["dense"], dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    rows = [json.loads(x) for x in Path(assets["rollouts"]).read_text().splitlines()]
    for r in rows:
        prompt = tok(r["prompt"])["input_ids"]
        ids = torch.tensor([prompt + r["completion_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        picked = logp[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None])[:, 0]
        r["logprobs"] = (picked + noise * torch.randn(picked.shape, generator=g)).tolist()
    path = Path(assets["rollouts"]).with_name("rollouts_logprobs.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {**assets, "rollouts": str(path)}


#: TRL's metrics compared with mdtk's (those a run logs)
COMPARED = ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy",
            "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
            "cispo_clip_ratio", "completions/mean_length", "completions/clipped_ratio",
            "rewards/recorded/mean", "rewards/recorded/std",
            "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean",
            "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
            "sampling/importance_sampling_ratio/max")


def trl_steps(name: str, settings: dict[str, Any], assets: dict[str, str],
              **extra: Any) -> list[dict]:
    """TRL's GRPOTrainer's logged steps (in the test process): the recorded groups of
    ``assets["rollouts"]`` in file order through ``rollout_func`` (with their ``logprobs``
    where the rows have them), their rewards through a reward function named like mdtk's;
    ``settings`` and ``extra``: GRPOConfig's (TRL's names). With ``use_vllm`` TRL starts its
    colocated vLLM engine, which the rollouts never use: its weight sync (a ``load_weights``
    vLLM's CPU backend refuses) is skipped; the loss and metrics are TRL's own."""
    import torch
    import transformers as tf
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from toolkit.train.data import load_tokenizer

    tok = load_tokenizer(assets["tokenizer"])
    rows = [json.loads(x) for x in Path(assets["rollouts"]).read_text().splitlines()]
    groups = [rows[i:i + GROUP] for i in range(0, len(rows), GROUP)]
    queue = list(groups)

    def rollout_func(prompts, trainer):
        picked = []
        for i in range(0, len(prompts), GROUP):
            group = queue.pop(0)
            assert all(p == group[0]["prompt"] for p in prompts[i:i + GROUP])
            picked += group
        return {"prompt_ids": [tok(r["prompt"])["input_ids"] for r in picked],
                "completion_ids": [r["completion_ids"] for r in picked],
                "logprobs": [r.get("logprobs", [0.0] * len(r["completion_ids"]))
                             for r in picked],
                "recorded_reward": [r["reward"] for r in picked]}

    def recorded(prompts, completions, completion_ids, recorded_reward, **kw):
        return recorded_reward

    args = GRPOConfig(output_dir=str(Path(assets["work"]) / "trl" / name), use_cpu=True,
                      bf16=False, report_to=[], disable_tqdm=True,
                      per_device_train_batch_size=GLOBAL, num_generations=GROUP,
                      learning_rate=LR, lr_scheduler_type="constant", adam_beta2=0.95,
                      max_grad_norm=1.0, weight_decay=0.0, logging_steps=1, max_steps=STEPS,
                      save_strategy="no", shuffle_dataset=False, seed=1234, **settings, **extra)
    model = tf.AutoModelForCausalLM.from_pretrained(assets["dense"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[recorded], args=args,
                          train_dataset=Dataset.from_list([{"prompt": g[0]["prompt"]}
                                                           for g in groups]),
                          processing_class=tok, rollout_func=rollout_func)
    if args.use_vllm:
        trainer.vllm_generation.sync_weights = lambda *a, **k: None
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def config(case: GrpoCase, assets: dict[str, str], out: Path):
    from dist_checks import trainer_checks as tc

    settings = [f"grpo.{k}={v}" for k, v in RUNS[case.run].items()]
    if not any(o.startswith("grpo.rewards") for o in case.overrides):
        settings += [f"grpo.rollouts={assets['rollouts']}", "data.sources=[]"]
    settings += ["data.mode=grpo", f"grpo.num_generations={GROUP}",
                 f"train.micro_batch={case.micro}", f"train.global_batch={GLOBAL}",
                 f"train.seq_len={SEQ}", f"optim.lr={LR}",
                 f"model.path={assets[case.model]}", *case.overrides]
    base = tc.Case(case.label, tp=case.tp, pp=case.pp, vpp=case.vpp, ep=case.ep, sp=case.sp,
                   zero=case.zero, steps=STEPS, overrides=tuple(settings))
    return tc.config(base, assets, out)


def run_case(case: GrpoCase, assets: dict[str, str], workdir: str) -> dict[str, Any]:
    from toolkit.train import trainer

    result = trainer.run(config(case, assets, Path(workdir) / case.label))
    return {"case": case.label, "losses": result.losses, "metrics": result.metrics}


def run_cases(cases: list[GrpoCase], assets: dict[str, str], workdir: str) -> list[dict]:
    return [run_case(c, assets, workdir) for c in cases]


def run_example(model: str, workdir: str, steps: int) -> dict[str, Any]:
    """The bundled example (bundled:examples/grpo_tiny.yaml) on the demo's tiny Llama (random
    weights) for ``steps`` steps: its per-step mean rewards."""
    from toolkit.train import trainer
    from toolkit.train.config import load_config

    cfg = load_config("bundled:examples/grpo_tiny.yaml", [
        f"model.path={model}", f"model.tokenizer={model}", f"output_dir={workdir}/grpo_tiny",
        "checkpoint.resume=none", f"train.steps={steps}"])
    result = trainer.run(cfg)
    return {"case": "example", "rewards": [m["reward"] for m in result.metrics],
            "metrics": result.metrics}


def run_stale_vllm(case: GrpoCase, assets: dict[str, str], workdir: str) -> dict[str, Any]:
    """``case`` with its vLLM engine given the live weights before the first generation batch
    only: the control that shows the log-probability gap sees a stale engine."""
    from toolkit.infer.vllm_engine import VllmSampler

    sync = VllmSampler.sync

    def first_only(self) -> int:
        if getattr(self, "synced_once", False):
            return 0
        self.synced_once = True
        return sync(self)

    VllmSampler.sync = first_only
    try:
        return run_case(case, assets, workdir)
    finally:
        VllmSampler.sync = sync


def first_token_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """A reward that differs within almost every group (the first sampled token's id mod 7), so
    every step's advantages, and so its update, are not zero."""
    return [(ids[0] % 7) / 7 if ids else 0.0 for ids in completion_ids]
