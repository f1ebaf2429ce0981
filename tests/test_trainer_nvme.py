"""An ``mdtk train`` run with ``deepspeed.offload: nvme`` (ZeRO-3, 2 gloo ranks) converts to HF
equal, bit for bit, to its own HF export, straight from its checkpoint (no resume).

The trainer's generator offloads the optimizer only (parameters stay in memory), so its fp32
master weights exist only in the swap files DeepSpeed copies into the checkpoint; the export is
gathered from the engine's fp32 parameters, which ZeRO-3 copies from those same master weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_checks import trainer_nvme_checks as nc
from safetensors.torch import load_file

STEPS = 2


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.nvme
def test_trainer_nvme_checkpoint_converts_to_its_export(rank_pool_2, async_io_ready, tmp_path):
    from toolkit.checkpoint.safe_load import load_torch
    from toolkit.convert import convert

    if async_io_ready:
        pytest.skip(async_io_ready)
    assets = nc.make_wide_assets(tmp_path)
    (tmp_path / "nvme").mkdir()
    r0, r1 = rank_pool_2.run(nc.nvme_run, assets, str(tmp_path / "runs"),
                             str(tmp_path / "nvme"), STEPS, timeout=600)
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == STEPS
    assert r0["losses"][1] < r0["losses"][0]
    zero = r0["zero"]
    assert (zero["stage"], zero["offload_optimizer"]["device"]) == (3, "nvme")
    assert "offload_param" not in zero  # what the refusal in checkpoint/deepspeed.py is about

    engine = Path(r0["checkpoint"]) / "engine"
    for rank in (0, 1):  # the master weights are only in the swap files: empty in the .pt
        optim = load_torch(engine / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        assert [t.numel() for t in optim["optimizer_state_dict"]["fp32_flat_groups"]] == [0]
        swaps = sorted(p.name for p in (engine / "offloaded_tensors" / f"rank{rank:02d}")
                       .glob("*.swp"))
        ids = swaps[0].split(".")[0]  # "<first>_<last>" ds_id of the one sub group
        first_id, last_id = map(int, ids.split("_"))
        assert last_id - first_id == 14  # megatron-core's 15 parameters (fused qkv, fc1)
        assert swaps == [f"{ids}.tensor.swp", f"exp_avg-{ids}.tensor.swp",
                         f"exp_avg_sq-{ids}.tensor.swp"]

    convert(Path(r0["checkpoint"]), tmp_path / "converted", "hf", progress=False)
    mine, theirs = _weights(tmp_path / "converted"), _weights(Path(r0["export"]))
    assert sorted(mine) == sorted(theirs) and len(mine) == 21
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype == torch.float32, name
        assert torch.equal(mine[name], value), name  # bit-exact: the same fp32 values
    first = load_file(Path(assets["wide"]) / "model.safetensors")
    assert not torch.equal(first["model.embed_tokens.weight"],
                           mine["model.embed_tokens.weight"])  # trained, not the start
