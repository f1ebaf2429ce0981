"""The cost model against published runs: the estimate for each published layout, its error,
and where the published layout ranks among the planner's plans for that model and cluster.

Knobs a source does not state (micro-batch, vpp, recompute) are taken from the planner's best
fitting plan with the stated knobs pinned. Each framework is searched with the sharding it
offers (Megatron-LM: DDP or distributed optimizer = ZeRO-0/1; FSDP: NO_SHARD / SHARD_GRAD_OP /
FULL_SHARD = ZeRO-0/2/3) and no offload (none of the runs offloads).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.memory import GIB, Cluster
from toolkit.planner.cost import FRAMEWORKS, Efficiency, Workload
from toolkit.planner.devices import get_device
from toolkit.planner.published import PublishedRun
from toolkit.planner.search import Budget, Planned, SearchSpace, layout_key, search

#: The runs fit the real GPUs, so they are judged against all of its memory (no headroom).
PUBLISHED_BUDGET = Budget(headroom=0.0, gpu_reserve=0)

#: The runs the efficiency constants are fitted on (scripts/calibrate_planner.py): small and
#: large, short and long sequences, both frameworks; the others are held out.
CALIBRATE = ("megatron-lm 1.7B", "megatron-lm 16B", "megatron-lm 70B", "megatron-lm 314B",
             "llm-foundry mpt-760m s2048 8gpu", "llm-foundry mpt-1b s32768 8gpu",
             "llm-foundry mpt-7b s2048 8gpu", "llm-foundry mpt-30b s2048 32gpu")
ZERO_BY_FRAMEWORK = {"megatron-lm": (0, 1), "fsdp": (0, 2, 3), "mdtk": (0, 1, 2, 3)}


def _setting(run: PublishedRun) -> tuple[Workload, Cluster, SearchSpace]:
    nodes = max(1, run.gpus // 8)
    cluster = Cluster(nodes=nodes, gpus_per_node=min(8, run.gpus),
                      gpu_mem=run.gpu_mem_gib * GIB, cpu_mem=2048 * GIB)
    work = Workload(run.seq_len, run.global_batch, "bf16")
    space = SearchSpace(zero_stages=ZERO_BY_FRAMEWORK[run.framework], offloads=("none",),
                        allow_cp=run.cp > 1)
    return work, cluster, space


def pinned(run: PublishedRun) -> tuple[Workload, Cluster, SearchSpace]:
    """The run's setting with every knob the source states pinned."""
    work, cluster, space = _setting(run)
    fixed = {"tp": run.tp, "pp": run.pp, "cp": run.cp, "dp": run.dp, "zero": run.zero}
    for name in ("micro_batch", "vpp", "recompute"):
        if getattr(run, name) is not None:
            fixed[name] = getattr(run, name)
    return work, cluster, SearchSpace(zero_stages=space.zero_stages, offloads=space.offloads,
                                      allow_cp=space.allow_cp, fixed=tuple(fixed.items()))


def published_plan(run: PublishedRun, eff: Efficiency | None = None) -> Planned | None:
    """The planner's best plan with every knob the source states pinned (None: the memory
    model says the published layout does not fit)."""
    work, cluster, space = pinned(run)
    result = search(run.model, work, cluster, get_device(run.device), top=1, space=space,
                    framework=FRAMEWORKS[run.framework], eff=eff, budget=PUBLISHED_BUDGET)
    return result.plans[0] if result.plans else None


def published_rank(run: PublishedRun, eff: Efficiency | None = None, top: int = 5
                   ) -> tuple[int | None, list[tuple]]:
    """1-based position of the published (tp, pp, cp, ep, dp) among the planner's ``top``
    distinct layouts for this model and cluster (None: not among them), and those layouts."""
    work, cluster, space = _setting(run)
    result = search(run.model, work, cluster, get_device(run.device), top=top, space=space,
                    framework=FRAMEWORKS[run.framework], eff=eff, group=layout_key,
                    budget=PUBLISHED_BUDGET)
    keys = [layout_key(p.candidate) for p in result.plans]
    want = (run.tp, run.pp, run.cp, 1, run.dp)
    return (keys.index(want) + 1 if want in keys else None), keys


@dataclass(frozen=True)
class Check:
    run: PublishedRun
    predicted: float | None  # tokens/s per GPU for the published layout
    rank: int | None
    plan: Planned | None

    @property
    def error(self) -> float | None:
        """predicted / published - 1."""
        return None if self.predicted is None else (
            self.predicted / self.run.tokens_per_s_per_gpu - 1)


def check(run: PublishedRun, eff: Efficiency | None = None, *, ranks: bool = True) -> Check:
    plan = published_plan(run, eff)
    rank = published_rank(run, eff)[0] if ranks else None
    return Check(run, plan.cost.tokens_per_s_per_gpu if plan else None, rank, plan)
