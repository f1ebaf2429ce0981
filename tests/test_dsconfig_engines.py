"""Every generated preset initialises a real DeepSpeed engine on CPU (2 gloo ranks) and trains a
tiny HF Llama for 3 steps on a fixed batch with falling loss.

Three edits adapt a preset to this machine, nothing else: the batch keys are rescaled to the
test's world (the presets are sized for 8 GPUs), the scheduler runs at a constant 3e-3 (3 steps
leave no room for warmup), and ``torch_adam`` picks torch's AdamW where DeepSpeed would
JIT-compile FusedAdam (no offload). Offload presets run DeepSpeed's CPU Adam as emitted. The NVMe
run also saves a checkpoint, which must convert to HF equal to the engine's own export.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
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
        kwargs = dict(nvme_dir=str(tmp_path), vocab_size=4096, save_dir=str(tmp_path / "ckpt"))
    # (the rank pool builds DeepSpeed's CPU Adam / async_io in this process first)
    results = rank_pool_2.run(memory_checks.train_and_measure, cfg, steps=3, timeout=600,
                              **kwargs)
    for rank, r in enumerate(results):
        losses = r["losses"]
        assert losses[0] > losses[1] > losses[2], f"{name} rank {rank}: {losses}"
    if "save_dir" in kwargs:
        _assert_nvme_checkpoint_converts_to_its_export(Path(kwargs["save_dir"]), tmp_path)


def _assert_nvme_checkpoint_converts_to_its_export(ckpt: Path, tmp_path: Path) -> None:
    """The fp32 master weights live only in the NVMe swap files DeepSpeed copied into the
    checkpoint (its optimizer files hold empty tensors for them); ``mdtk convert`` reads them,
    and cast to bf16 they equal bit for bit the engine's own 16-bit export (``save_16bit_model``,
    what HF Trainer writes at ZeRO-3): DeepSpeed's bf16 weights are those fp32 values rounded."""
    from toolkit.checkpoint.deepspeed import DeepSpeedCheckpoint
    from toolkit.checkpoint.torchfree.safe_load import load_torch
    from toolkit.convert import convert

    engine = ckpt / (ckpt / "latest").read_text().strip()
    # per rank: the fp32 partition and both moments of one sub group of all 21 parameters,
    # named by its first and last ds_id (ZeRO-3 counts on across the engines of a process)
    swaps = sorted(p.relative_to(engine).as_posix() for p in engine.rglob("*.swp"))
    first = int(swaps[0].rsplit("/", 1)[1].split("_")[0])
    assert swaps == [f"offloaded_tensors/rank{r:02d}/{s}{first}_{first + 20}.tensor.swp"
                     for r in (0, 1) for s in ("", "exp_avg-", "exp_avg_sq-")]
    optim = load_torch(engine / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert [t.numel() for t in optim["optimizer_state_dict"]["fp32_flat_groups"]] == [0]
    theirs = load_torch(ckpt / "export" / "pytorch_model.bin")
    convert(ckpt, tmp_path / "hf32", "hf", progress=False)
    convert(ckpt, tmp_path / "hf", "hf", dtype="bf16", progress=False)
    fp32, mine = _safetensors(tmp_path / "hf32"), _safetensors(tmp_path / "hf")
    assert sorted(mine) == sorted(theirs) and len(mine) == 21
    for k, v in theirs.items():
        assert mine[k].dtype == v.dtype == torch.bfloat16
        assert torch.equal(mine[k], v), k
    # fp32 master, not the bf16 copy: the bf16 rounding shows (and nothing else does)
    assert max((fp32[k] - v.float()).abs().max().item() for k, v in theirs.items()) > 1e-4
    assert all(torch.equal(fp32[k].to(torch.bfloat16), v) for k, v in theirs.items())
    moments = DeepSpeedCheckpoint.open(ckpt, state="exp_avg_sq").ranks[0].read
    assert all(moments(k).abs().sum() > 0 for k in theirs)  # Adam's moments are read too


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
