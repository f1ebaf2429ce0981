"""Launch command lines: torchrun argv and Slurm scripts, and a real 2-rank launch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from toolkit.launch import LaunchSpec, slurm_script, torchrun_argv


def test_torchrun_single_node():
    argv = torchrun_argv(LaunchSpec(2, master_port=29555), ["env", "--json"])
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in argv and "--master-port=29555" in argv
    assert argv[-4:] == ["-m", "toolkit.cli", "env", "--json"]


def test_torchrun_multi_node_names_node_rank():
    argv = torchrun_argv(LaunchSpec(8, nnodes=4, node_rank=3, master_addr="n0"), ["train", "c.y"])
    assert "--nnodes=4" in argv and "--node-rank=3" in argv and "--master-addr=n0" in argv


def test_slurm_script_one_torchrun_per_node():
    text = slurm_script(LaunchSpec(8, nnodes=2), ["train", "cfg.yaml", "train.steps=10"],
                        partition="gpu")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
    assert "#SBATCH --partition=gpu" in text
    assert "--rdzv-backend=c10d" in text
    assert text.rstrip().endswith("-m toolkit.cli train cfg.yaml train.steps=10")


@pytest.mark.parametrize("kwargs", [dict(nproc_per_node=0), dict(nproc_per_node=2, node_rank=1)])
def test_bad_spec(kwargs):
    with pytest.raises(ValueError):
        LaunchSpec(**kwargs)


def test_launch_runs_two_real_ranks(tmp_path):
    """`mdtk launch -n 2 -- env --json` starts two processes through torchrun."""
    from toolkit.runtime.ports import free_port

    out = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "launch", "-n", "2", "--master-port",
         str(free_port()),
         "--", "env", "--json"],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count('"versions"') == 2
