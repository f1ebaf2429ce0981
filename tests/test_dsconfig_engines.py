"""Every generated preset initialises a real DeepSpeed engine on CPU (2 gloo ranks) and trains a
tiny HF Llama for 3 steps on a fixed batch with falling loss.

Three edits adapt a preset to this machine, nothing else: the batch keys are rescaled to the
test's world (the presets are sized for 8 GPUs), the scheduler runs at a constant 3e-3 (3 steps
leave no room for warmup), and ``torch_adam`` picks torch's AdamW where DeepSpeed would
JIT-compile FusedAdam (no offload). Offload presets run DeepSpeed's CPU Adam as emitted.
"""

from __future__ import annotations

import copy

import pytest
from dist_checks import memory_checks

from toolkit.dsconfig import preset_configs
from toolkit.dsconfig.presets import DS_PRESETS

WORLD = 2


def for_this_machine(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg.update(train_batch_size=2 * WORLD, train_micro_batch_size_per_gpu=2,
               gradient_accumulation_steps=1)
    # 3 steps: no warmup from lr 0 (DeepSpeed's log warmup gives lr 0 at step 0)
    cfg["scheduler"]["params"].update(warmup_num_steps=2, total_num_steps=10,
                                      warmup_min_lr=3e-3, warmup_max_lr=3e-3)
    if "offload_optimizer" not in cfg.get("zero_optimization", {}):
        cfg["optimizer"]["params"]["torch_adam"] = True
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.nvme) if "nvme" in n else n
                                  for n in DS_PRESETS])
def test_preset_trains_on_real_engine(name, rank_pool_2, tmp_path, request):
    cfg = for_this_machine(preset_configs()[name])
    kwargs = {}
    if name == "zero_infinity_nvme":
        reason = request.getfixturevalue("async_io_ready")
        if reason:
            pytest.skip(reason)
        # DeepSpeed never swaps tensors under 1 MiB: a bigger vocabulary makes swapping real
        kwargs = dict(nvme_dir=str(tmp_path), vocab_size=4096)
    # (the rank pool builds DeepSpeed's CPU Adam / async_io in this process first)
    results = rank_pool_2.run(memory_checks.train_and_measure, cfg, steps=3, timeout=600,
                              **kwargs)
    for rank, r in enumerate(results):
        losses = r["losses"]
        assert losses[0] > losses[1] > losses[2], f"{name} rank {rank}: {losses}"
