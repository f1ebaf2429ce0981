"""``mdtk train`` runs with ``deepspeed.offload: nvme`` (ZeRO-3, 2 gloo ranks) convert to HF
equal, bit for bit, to their own HF export, straight from their checkpoint (no resume).

The trainer's generated config offloads the optimizer only; a second run adds the parameters
(user config). Either way the fp32 master weights exist only in the optimizer swap files
DeepSpeed copies into the checkpoint (parameter swap files are never copied, and are not needed:
they hold copies of those masters); the export is gathered from the engine's fp32 parameters,
which ZeRO-3 copies from the same masters, so equality is exact.
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
    if async_io_ready:
        pytest.skip(async_io_ready)
    assets = nc.make_wide_assets(tmp_path)
    (tmp_path / "nvme").mkdir()
    r0, r1 = rank_pool_2.run(nc.nvme_run, assets, str(tmp_path / "runs"),
                             str(tmp_path / "nvme"), STEPS, timeout=600)
    zero = r0["optimizer"]["zero"]  # the trainer's own config: optimizer on NVMe only
    assert (zero["stage"], zero["offload_optimizer"]["device"]) == (3, "nvme")
    assert "offload_param" not in zero
    assert r0["params"]["zero"]["offload_param"]["device"] == "nvme"
    _check_param_swaps(tmp_path / "nvme" / "params", Path(r0["params"]["export"]))
    start = load_file(Path(assets["wide"]) / "model.safetensors")["model.embed_tokens.weight"]
    for name in ("optimizer", "params"):
        run = r0[name]
        assert run["losses"] == r1[name]["losses"] and len(run["losses"]) == STEPS
        assert run["losses"] == r0["optimizer"]["losses"]  # where tensors live changes nothing
        assert run["losses"][1] < run["losses"][0]
        mine = _check_checkpoint(Path(run["checkpoint"]), tmp_path / f"converted_{name}",
                                 Path(run["export"]))
        assert not torch.equal(start, mine["model.embed_tokens.weight"])  # trained


def _check_param_swaps(nvme: Path, export: Path) -> None:
    """The parameters really were swapped to NVMe, in fp32: DeepSpeed swaps partitions from
    1 MiB, here the embedding's and the output's (8192 x 64 fp32, 1 MiB per rank each), and
    writes them back from the fp32 masters after every step, so each rank's two files hold its
    halves of the exported tensors bit for bit. (DeepSpeed 0.19.8 on a CPU without fp16 sizes
    and writes them in bf16, where 512 KiB halves are never swapped, unless mdtk's CPU mode
    corrects the dtype: toolkit/runtime/cpu_compat.patch_deepspeed.)"""
    weights = _weights(export)
    halves = {(rank, name): weights[name].flatten().chunk(2)[rank]
              for rank in (0, 1) for name in ("model.embed_tokens.weight", "lm_head.weight")}
    for rank in (0, 1):
        files = sorted((nvme / "zero_stage_3" / "float32params" / f"rank{rank}")
                       .glob("*_param.tensor.swp"))
        assert [f.stat().st_size for f in files] == [2**20, 2**20], files
        found = sorted(name for f in files for (r, name), half in halves.items()
                       if r == rank and torch.equal(
                           torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.float32), half))
        assert found == ["lm_head.weight", "model.embed_tokens.weight"], (rank, found)


def _check_checkpoint(step: Path, out: Path, export: Path) -> dict[str, torch.Tensor]:
    """Master weights only in the checkpoint's optimizer swap files (the .pt groups are empty);
    converted to HF they equal the run's export bit for bit."""
    from toolkit.checkpoint.torchfree.safe_load import load_torch
    from toolkit.convert import convert

    engine = step / "engine"
    assert not list(engine.rglob("*_param.tensor.swp"))  # DeepSpeed copies the optimizer's only
    for rank in (0, 1):
        optim = load_torch(engine / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        assert [t.numel() for t in optim["optimizer_state_dict"]["fp32_flat_groups"]] == [0]
        swaps = sorted(p.name for p in (engine / "offloaded_tensors" / f"rank{rank:02d}")
                       .glob("*.swp"))
        ids = swaps[0].split(".")[0]  # "<first>_<last>" ds_id of the one sub group
        first_id, last_id = map(int, ids.split("_"))
        assert last_id - first_id == 14  # megatron-core's 15 parameters (fused qkv, fc1)
        assert swaps == [f"{ids}.tensor.swp", f"exp_avg-{ids}.tensor.swp",
                         f"exp_avg_sq-{ids}.tensor.swp"]
    convert(step, out, "hf", progress=False)
    mine, theirs = _weights(out), _weights(export)
    assert sorted(mine) == sorted(theirs) and len(mine) == 15 + 6  # q/k/v, gate/up split
    for name, value in theirs.items():
        assert mine[name].dtype == value.dtype == torch.float32, name
        assert torch.equal(mine[name], value), name  # bit-exact: the same fp32 values
    return mine
