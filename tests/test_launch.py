"""Launch command lines: torchrun argv, Slurm scripts, the DeepSpeed launcher, NCCL defaults,
layout checks before anything starts, and real 2-rank launches (torchrun, DeepSpeed launcher).

The fault-tolerance runs (killed workers, restarts, SIGTERM, heartbeat) are in
test_launch_faults.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from toolkit.launch import LaunchSpec, network, rank_env, slurm_script, torchrun_argv
from toolkit.launch.dslauncher import HostfileError, check_hostfile, read_hostfile

pytestmark = pytest.mark.late  # see tests/conftest.py


def test_torchrun_single_node():
    argv = torchrun_argv(LaunchSpec(2, master_port=29555), ["env", "--json"])
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in argv and "--master-port=29555" in argv
    assert argv[-4:] == ["-m", "toolkit.cli", "env", "--json"]


def test_torchrun_multi_node_names_node_rank():
    argv = torchrun_argv(LaunchSpec(8, nnodes=4, node_rank=3, master_addr="n0"), ["train", "c.y"])
    assert "--nnodes=4" in argv and "--node-rank=3" in argv
    # c10d rendezvous on node 0, which hosts the store
    assert "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=n0:29500" in argv
    assert "--rdzv-conf=is_host=false" in argv
    node0 = torchrun_argv(LaunchSpec(8, nnodes=4, node_rank=0, master_addr="n0"), ["env"])
    assert "--rdzv-conf=is_host=true" in node0


def test_torchrun_restarts_use_c10d_and_a_fresh_store_per_attempt():
    spec = LaunchSpec(4, max_restarts=2, master_port=29555)
    argv = torchrun_argv(spec, ["env"])
    assert "--max-restarts=2" in argv and "--rdzv-endpoint=127.0.0.1:29555" in argv
    assert rank_env(spec, {}, cores=4)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in rank_env(LaunchSpec(4), {}, cores=4)


def test_slurm_script_one_torchrun_per_node():
    text = slurm_script(LaunchSpec(8, nnodes=2), ["train", "cfg.yaml", "train.steps=10"],
                        partition="gpu")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
    assert "#SBATCH --partition=gpu" in text
    assert "--rdzv-backend=c10d" in text
    assert "  -m toolkit.cli train cfg.yaml train.steps=10 &\n" in text


@pytest.mark.parametrize("kwargs", [dict(nproc_per_node=0), dict(nproc_per_node=2, node_rank=1)])
def test_bad_spec(kwargs):
    with pytest.raises(ValueError):
        LaunchSpec(**kwargs)


def test_launch_runs_two_real_ranks(tmp_path):
    """`mdtk launch -n 2 -- --help` starts two processes through torchrun, each running mdtk
    (``--help``: a rank command that imports no torch; `mdtk env` took 4.7 s in each rank, and
    tests/test_cli_env.py checks it)."""
    from toolkit.runtime.ports import free_port

    out = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "launch", "-n", "2", "--master-port",
         str(free_port()),
         "--", "--help"],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("Usage: python -m toolkit.cli") == 2


def test_launch_runs_two_real_ranks_with_the_deepspeed_launcher(tmp_path):
    """`mdtk launch --scheduler deepspeed -n 2 -- --help`: DeepSpeed's runner starts both."""
    from toolkit.runtime.ports import free_port

    out = subprocess.run(
        [sys.executable, "-m", "toolkit.cli", "launch", "--scheduler", "deepspeed", "-n", "2",
         "--master-port", str(free_port()), "--", "--help"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("Usage: python -m toolkit.cli") == 2
    assert "localhost slots=2" in out.stderr and "deepspeed --hostfile=" in out.stdout
    assert list(tmp_path.iterdir()) == []  # the hostfile of a bare command is a temporary file


# -- a training config against cluster shapes (in process: no ranks start) -----------------------

@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    cfg = root / "tiny.yaml"
    cfg.write_text(
        f"output_dir: {root / 'run'}\n"
        "model: {config: bundled:examples/tiny_llama_config.json, tokenizer: tok}\n"
        "data: {mode: pretrain, sources: [bundled:examples/data/pretrain.jsonl]}\n"
        "train: {steps: 10, micro_batch: 1, global_batch: 64, seq_len: 64}\n")
    return cfg


def _mdtk(*args: str):
    from typer.testing import CliRunner

    from toolkit.cli import app

    return CliRunner().invoke(app, list(args))


SHAPES = [  # nodes, GPUs per node, overrides, expected dp
    (1, 8, ["parallel.tp=2"], 4),
    (2, 8, ["parallel.tp=4", "parallel.pp=2"], 2),
    (4, 4, ["parallel.tp=2", "parallel.pp=2"], 4),
    (16, 8, ["parallel.tp=8", "parallel.pp=2"], 8),
]


@pytest.mark.parametrize("nodes,gpus,overrides,dp", SHAPES)
def test_sbatch_script_for_cluster_shape(tiny_config, tmp_path, nodes, gpus, overrides, dp):
    res = _mdtk("launch", str(tiny_config), *overrides, "--nodes", str(nodes),
                "--gpus-per-node", str(gpus), "--scheduler", "slurm", "--network", "ib",
                "--time", "02:00:00", "--stop-minutes", "7", "--dry-run")
    assert res.exit_code == 0, res.output
    script = res.stdout
    assert f"{nodes} x {gpus} = {nodes * gpus} ranks: dp={dp}" in res.stderr
    for line in (f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
                 f"#SBATCH --gpus-per-node={gpus}", "#SBATCH --time=02:00:00",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR1@420",
                 f"#SBATCH --output={tiny_config.parent / 'run' / 'logs'}/%x-%j.out",
                 f"  --nproc-per-node={gpus} --nnodes=$SLURM_NNODES \\",
                 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 f'export MDTK_STOP_FILE="{tiny_config.parent / "run" / "STOP"}"',
                 "export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"):
        assert line in script.splitlines(), line
    # InfiniBand defaults only where traffic leaves the node
    assert ("export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}" in script) == (nodes > 1)
    assert f"-m toolkit.cli train {tiny_config} {' '.join(overrides)} &" in script
    path = tmp_path / "job.sh"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("nodes,gpus,overrides,message", [
    (1, 3, ["parallel.tp=2"], "3 GPUs (1 node x 3) with tp=2: world size 3 is not divisible by "
                              "tp*pp*cp = 2*1*1 = 2"),
    (3, 2, ["parallel.tp=2", "parallel.pp=2"], "6 GPUs (3 nodes x 2) with tp=2, pp=2"),
    (2, 4, ["train.global_batch=12"], "8 GPUs (2 nodes x 4) with no model parallelism: "
                                      "train.global_batch=12 is not divisible by"),
])
@pytest.mark.parametrize("scheduler", ["slurm", "torchrun"])
def test_shape_the_layout_cannot_fill_is_refused_before_anything_runs(
        tiny_config, nodes, gpus, overrides, message, scheduler):
    res = _mdtk("launch", str(tiny_config), *overrides, "--nodes", str(nodes),
                "--gpus-per-node", str(gpus), "--scheduler", scheduler)
    assert res.exit_code != 0
    assert message in str(res.exception)
    assert not (tiny_config.parent / "run").exists()  # no script, log folder or rank written


def test_sbatch_trap_asks_the_ranks_to_stop_and_requeues(tiny_config, tmp_path):
    """The script's own logic, run by bash. Slurm is not installed here: stand-ins for srun
    (a job that exits 75 once the stop file appears, as the trainer does) and scontrol
    (records its arguments) take their place on PATH."""
    import os
    import signal
    import time

    res = _mdtk("launch", str(tiny_config), "--nodes", "2", "--gpus-per-node", "2",
                "--scheduler", "slurm", "--slurm", str(tmp_path / "job.sh"))
    assert res.exit_code == 0, res.output
    assert (tiny_config.parent / "run" / "logs").is_dir()  # sbatch needs it to exist
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho node7\n')
    started = tmp_path / "srun.started"
    (bin_dir / "srun").write_text(
        f'#!/bin/sh\ntouch {started}\n'
        'while [ ! -e "$MDTK_STOP_FILE" ]; do sleep 0.05; done\nexit 75\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    stop = tiny_config.parent / "run" / "STOP"
    stop.write_text("")  # left by an earlier run of this job: the script removes it first
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node[7-8]", "SLURM_NNODES": "2"}
    job = subprocess.Popen(["bash", str(tmp_path / "job.sh")], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.poll() is None and not stop.exists()
    job.send_signal(signal.SIGUSR1)  # what Slurm sends --stop-minutes before the limit
    output, _ = job.communicate(timeout=30)
    assert job.returncode == 75, output
    assert "asking the ranks to save and stop" in output
    assert "rendezvous node7:29500" in output
    assert calls.read_text().splitlines() == ["show hostnames node[7-8]", "requeue 42"]


def test_nccl_defaults_per_network_and_the_user_wins():
    ib, eth = network.nccl_defaults("ib", 2), network.nccl_defaults("ethernet", 2)
    assert ib["NCCL_IB_DISABLE"] == "0" and eth["NCCL_IB_DISABLE"] == "1"
    assert "NCCL_SOCKET_NTHREADS" in eth and "NCCL_SOCKET_NTHREADS" not in ib
    assert "NCCL_IB_DISABLE" not in network.nccl_defaults("ib", 1)  # one node: NVLink/shm
    env = network.apply(ib, {"NCCL_IB_DISABLE": "1"})
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_NET_GDR_LEVEL"] == "PHB"
    lines = network.describe(ib, {"NCCL_IB_DISABLE": "1"})
    assert "NCCL_IB_DISABLE=1 (yours)" in lines and "NCCL_NET_GDR_LEVEL=PHB (default)" in lines


def test_deepspeed_hostfile_checked_against_the_shape(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# two nodes\nnode1 slots=8\nnode2 slots=4\n")
    hosts = read_hostfile(path)
    assert hosts == {"node1": 8, "node2": 4}
    check_hostfile(hosts, LaunchSpec(4, nnodes=2), path)
    with pytest.raises(HostfileError, match="needs 2 host.s. with at least 8 slots"):
        check_hostfile(hosts, LaunchSpec(8, nnodes=2), path)
    res = _mdtk("launch", "--scheduler", "deepspeed", "--nodes", "2", "-n", "4", "--dry-run",
                "--hostfile", str(path), "--", "env")
    assert res.exit_code == 0, res.output
    assert (f"deepspeed --hostfile={path} --num_nodes=2 --num_gpus=4 --master_addr=127.0.0.1 "
            "--master_port=29500 --no_local_rank --no_ssh_check --module toolkit.cli env"
            ) in res.stdout
    res = _mdtk("launch", "--scheduler", "deepspeed", "--nodes", "2", "-n", "4", "--dry-run",
                "--", "env")
    assert res.exit_code != 0 and "needs --hostfile" in res.output


def test_free_ports_come_from_below_the_ephemeral_range():
    """Rendezvous ports are drawn below the range the OS hands out by itself (port-0 binds,
    every outgoing connection's source port), so no such socket can take one before its
    store binds it; each was bindable when drawn. A port in use is never handed out."""
    import socket
    from pathlib import Path

    from toolkit.runtime.ports import _bindable, free_port

    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(20000 <= p < start for p in ports), ports
    assert len(set(ports)) > 10  # drawn at random
    with socket.socket() as held:  # what the draw skips: a port something listens on
        held.bind(("127.0.0.1", ports[0]))
        held.listen()
        assert not _bindable(ports[0]) and _bindable(ports[1])
