"""Other tools take what mdtk writes as their own: the HF Trainer and accelerate train with every
``ds_configs/*_hf_trainer.json`` preset as written, and the ZeRO-3 NVMe reader cuts optimizer sub
groups exactly as DeepSpeed does.

The presets run in ONE job of the session's 2-rank pool (gloo ranks on CPU;
``dist_checks/hf_presets_run.py`` says what it does and the two machine edits; rank 0's
results are checked). Marked ``nvme``: it runs after the other tests, when the background
async_io build is done; without async_io the NVMe preset is only resolved (accelerate's
plugin), not trained, and its training checks skip with the reason.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from dist_checks import hf_presets_run

from toolkit.checkpoint.nvme_swap import sub_groups
from toolkit.dsconfig.presets import DS_PRESETS

ROOT = Path(__file__).resolve().parent.parent
HF_PRESETS = [f"{n}_hf_trainer" for n in DS_PRESETS]
LR = 1e-2  # hf_presets_run.LR
# the loss on the same batch after the 3 steps: one AdamW update at lr 1e-2 from random init
MIN_DROP = 0.05


@pytest.fixture(scope="module")
def launch(tmp_path_factory, async_io_ready, rank_pool_2) -> dict:
    work = tmp_path_factory.mktemp("hf_presets")
    rank0, _ = rank_pool_2.run(hf_presets_run.run_all, str(work), nvme=not async_io_ready,
                               timeout=900)
    return {"results": rank0, "nvme_skip": async_io_ready}  # rank 0's, as the launch wrote


def _trained(launch: dict, name: str, tool: str) -> dict:
    result = launch["results"][name][tool]
    if "nvme" in name and launch["nvme_skip"]:
        pytest.skip(f"{name} resolved only, not trained: {launch['nvme_skip']}")
    return result


def _assert_trains(r: dict) -> None:
    assert r["engine"] == "DeepSpeedEngine"  # DeepSpeed really ran, not a plain torch model
    assert r["autos"] == []  # every "auto" was filled
    first = r["losses"][0]
    assert len(r["losses"]) == 3
    # the first two updates run at lr 0 (DeepSpeed's log warmup from warmup_min_lr = 0)
    assert r["losses"] == pytest.approx([first] * 3, rel=1e-6)
    assert r["after"] < first - MIN_DROP, r


@pytest.mark.slow
@pytest.mark.nvme
@pytest.mark.parametrize("name", HF_PRESETS)
def test_hf_trainer_trains_on_preset(launch, name):
    r = _trained(launch, name, "hf")
    _assert_trains(r)
    assert r["lrs"] == pytest.approx([0.0, LR, LR])  # warmup_max_lr = learning_rate
    assert r["betas"] == [0.9, 0.999]  # written, equal to TrainingArguments' defaults


@pytest.mark.slow
@pytest.mark.nvme
@pytest.mark.parametrize("name", HF_PRESETS)
def test_accelerate_plugin_trains_on_preset(launch, name):
    """accelerate's DeepSpeedPlugin(hf_ds_config=preset) initialised for every preset (NVMe
    included) in the launch; prepare() and 3 steps with DummyOptim / DummyScheduler."""
    assert name in launch["results"]
    _assert_trains(_trained(launch, name, "accelerate"))


@pytest.mark.parametrize("dp,size", [(1, 10**9), (2, 1000), (2, 100), (3, 1), (4, 300)])
def test_nvme_sub_groups_are_deepspeeds(dp, size):
    """``nvme_swap.sub_groups`` cuts param groups into ZeRO-3 optimizer sub groups exactly as
    DeepSpeed's own ``_create_fp16_sub_groups`` does (called with the same partition sizes)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    groups = [{"embed": (512, 8), "q": (8, 8), "norm": (8,), "up": (32, 8), "down": (8, 32)},
              {"bias": (7,), "head": (512, 8)}]

    class Param(SimpleNamespace):
        def partition_numel(self) -> int:
            return math.ceil(math.prod(self.shape) / dp)

    theirs = []
    for g in groups:
        params = [Param(name=n, shape=s) for n, s in g.items()]
        cut = Stage3._create_fp16_sub_groups(SimpleNamespace(sub_group_size=size), params)
        theirs += [[p.name for p in sub] for sub in cut]
    assert sub_groups(groups, dp, size) == theirs
    assert len(theirs) > len(groups) or size == 10**9  # the cases do cut
