"""``mdtk estimate``: the per-rank memory breakdown of one layout and ZeRO stage.

The memory model is imported when the command runs (``mdtk`` imports every command module to
list it; the others do not need it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from toolkit import errors
from toolkit.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from toolkit.memory import Cluster, Estimate

# Options shared with ``mdtk ds-config`` (one definition, used by both commands).
MODEL = typer.Option(..., "--model", help="Preset name, config.json, folder or hub id.")
NODES = typer.Option(1, "--nodes", min=1)
GPUS = typer.Option(8, "--gpus-per-node", min=1)
GPU_MEM = typer.Option("80GB", "--gpu-mem", help="Memory per GPU, e.g. 80GB.")
CPU_MEM = typer.Option("1TB", "--cpu-mem", help="Host memory per node.")
TP = typer.Option(1, "--tp", min=1)
PP = typer.Option(1, "--pp", min=1)
CP = typer.Option(1, "--cp", min=1)
EP = typer.Option(1, "--ep", min=1)
VPP = typer.Option(None, "--vpp", min=1, help="Virtual pipeline stages per rank (interleaved).")
SP = typer.Option(False, "--sequence-parallel/--no-sequence-parallel")
SEQ = typer.Option(4096, "--seq-len", min=1)
MICRO = typer.Option(1, "--micro-batch", min=1)
GLOBAL = typer.Option(None, "--global-batch", min=1)
DTYPE = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32.")
RECOMPUTE = typer.Option("none", "--recompute", help="none, selective or full.")
FLASH = typer.Option(True, "--flash/--no-flash", help="Flash attention (no s^2 scores).")


def cluster_of(nodes: int, gpus: int, gpu_mem: str, cpu_mem: str, nvme_path: str | None = None,
               nvme_size: str | None = None) -> Cluster:
    from toolkit.memory import Cluster, parse_bytes

    return Cluster(nodes=nodes, gpus_per_node=gpus, gpu_mem=parse_bytes(gpu_mem),
                   cpu_mem=parse_bytes(cpu_mem), nvme_path=nvme_path,
                   nvme_size=parse_bytes(nvme_size) if nvme_size else None)


def layout_of(tp: int, pp: int, cp: int, ep: int, vpp: int | None, sp: bool) -> ParallelLayout:
    return ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp, sequence_parallel=sp)


def fail(message: str) -> None:
    errors.say(message)
    raise typer.Exit(1)


def print_estimate(est: Estimate, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from toolkit.memory import GIB

    table = Table(title=title)
    for col in ("what", "device", "GiB", "note"):
        table.add_column(col, justify="right" if col == "GiB" else "left")
    for item in est.items:
        note = ("peak only; " if item.transient else "") + item.note
        table.add_row(item.what, item.device, f"{item.bytes / GIB:.3f}", note.strip("; "))
    for device in ("gpu", "cpu", "nvme"):
        if est.total(device):
            table.add_row(f"[bold]total {device}", device, f"[bold]{est.total(device) / GIB:.3f}",
                          "")
    Console().print(table)


def estimate_cmd(
    model: str = MODEL, nodes: int = NODES, gpus_per_node: int = GPUS, gpu_mem: str = GPU_MEM,
    cpu_mem: str = CPU_MEM, tp: int = TP, pp: int = PP, cp: int = CP, ep: int = EP,
    vpp: int | None = VPP, sequence_parallel: bool = SP, seq_len: int = SEQ,
    micro_batch: int = MICRO, global_batch: int | None = GLOBAL, dtype: str = DTYPE,
    recompute: str = RECOMPUTE, flash: bool = FLASH,
    stage: int = typer.Option(0, "--stage", min=0, max=3),
    offload_optimizer: str = typer.Option("none", "--offload-optimizer", help="none/cpu/nvme"),
    offload_param: str = typer.Option("none", "--offload-param", help="none/cpu/nvme"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Per-rank bytes (parameters, gradients, optimizer, DeepSpeed buffers, activations)."""
    from toolkit.dsconfig.generator import zero_options
    from toolkit.memory import TrainShape, estimate, load_model_shape

    try:
        shape = load_model_shape(model)
        cluster = cluster_of(nodes, gpus_per_node, gpu_mem, cpu_mem)
        train = TrainShape(seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch,
                           dtype=dtype, recompute=recompute, flash_attention=flash)
        zero = zero_options(shape, stage, offload_optimizer, offload_param)
        est = estimate(shape, train, layout_of(tp, pp, cp, ep, vpp, sequence_parallel), zero,
                       cluster.world_size)
    except ValueError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(est.to_dict(), indent=2))
        return
    print_estimate(est, f"{shape.name}: {shape.num_params() / 1e9:.2f}B params, "
                   f"{est.layout.describe()}, ZeRO-{stage}, pipeline stage {est.stage}")


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate_cmd)
