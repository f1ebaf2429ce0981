"""``mdtk estimate``: the per-rank memory breakdown of one layout and ZeRO stage.

The memory model is imported when the command runs (``mdtk`` imports every command module to
list it; the others do not need it).
"""

from __future__ import annotations

import json

import typer

from toolkit.commands import options as opt
from toolkit.commands.printing import fail, print_estimate


def estimate_cmd(
    model: str = opt.MODEL, nodes: int = opt.NODES, gpus_per_node: int = opt.GPUS,
    gpu_mem: str = opt.GPU_MEM, cpu_mem: str = opt.CPU_MEM, tp: int = opt.TP, pp: int = opt.PP,
    cp: int = opt.CP, ep: int = opt.EP, vpp: int | None = opt.VPP,
    sequence_parallel: bool = opt.SP, seq_len: int = opt.SEQ, micro_batch: int = opt.MICRO,
    global_batch: int | None = opt.GLOBAL, dtype: str = opt.DTYPE,
    recompute: str = opt.RECOMPUTE, flash: bool = opt.FLASH,
    stage: int = typer.Option(0, "--stage", min=0, max=3),
    offload_optimizer: str = typer.Option("none", "--offload-optimizer", help="none/cpu/nvme"),
    offload_param: str = typer.Option("none", "--offload-param", help="none/cpu/nvme"),
    dpo: bool = opt.DPO, precompute_reference: bool = opt.PRECOMPUTE_REF,
    peft: str = opt.PEFT, lora_r: int = opt.LORA_R, lora_targets: str | None = opt.LORA_TARGETS,
    teacher: str | None = typer.Option(
        None, "--teacher", help="distillation: the teacher (preset, config.json, folder or hub "
        "id) at the student's layout: its frozen weights and one step's logits are counted"),
    as_json: bool = opt.AS_JSON,
) -> None:
    """Per-rank bytes (parameters, gradients, optimizer, DeepSpeed buffers, activations)."""
    from toolkit.dsconfig.generator import zero_options
    from toolkit.memory import TrainShape, dpo_fields, estimate, load_model_shape

    try:
        shape = load_model_shape(model, lora=opt.lora_of(peft, lora_r, lora_targets))
        cluster = opt.cluster_of(nodes, gpus_per_node, gpu_mem, cpu_mem)
        train = TrainShape(seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch,
                           dtype=dtype, recompute=recompute, flash_attention=flash,
                           teacher=load_model_shape(teacher) if teacher else None,
                           **dpo_fields(dpo, precompute_reference))
        zero = zero_options(shape, stage, offload_optimizer, offload_param)
        layout = opt.layout_of(tp, pp, cp, ep, vpp, sequence_parallel).resolve(cluster.world_size)
        est = estimate(shape, train, layout, zero)
    except ValueError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(est.to_dict(), indent=2))
        return
    lora = f" ({shape.trainable_params() / 1e6:.2f}M trainable, {peft})" if shape.lora else ""
    print_estimate(est, f"{shape.name}: {shape.num_params() / 1e9:.2f}B params{lora}, "
                   f"{est.layout.describe()}, ZeRO-{stage}, pipeline stage {est.stage}")


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate_cmd)
