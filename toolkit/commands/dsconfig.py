"""``mdtk ds-config``: generate a DeepSpeed config from the memory model, or lint one (--check)."""

from __future__ import annotations

from pathlib import Path

import typer

from toolkit.commands import options as opt
from toolkit.commands.printing import fail, print_estimate, print_traffic

WORLD_SIZE = typer.Option(None, "--world-size", min=1, help="With --check: ranks of the run; "
                          "DeepSpeed's own parser judges the batch keys at this world size.")
RECOMPUTE = typer.Option("auto", "--recompute", help=", ".join(("auto", *opt.RECOMPUTE_CHOICES))
                         + ". auto: tried "
                         "before offload, the fastest that fits (a trainer setting: reported, "
                         "not written in the JSON).")
GPU = typer.Option("h100", "--gpu", help="Device whose speed ranks the options with --recompute "
                   "auto (mdtk plan --gpu list).")
HF_TRAINER = typer.Option(False, "--hf-trainer", help='Write "auto" where both the HF Trainer and '
                          "accelerate's DeepSpeedPlugin fill the value (AdamW betas/eps: "
                          "TrainingArguments' defaults).")
HPZ = typer.Option("auto", "--hpz", help="ZeRO++ hpZ partition size (zero_hpz_partition_size): "
                   "auto (weighed with --recompute auto on several nodes: the GPUs per node "
                   "when it pays or saves cross-node bytes at no cost), 1 = off, N = use N "
                   "(stage 3, tp = pp = 1).")
DEEPSPEED_PARSE = typer.Option(
    False, "--deepspeed-parse/--no-deepspeed-parse",
    help="Also run DeepSpeed's own config parser on the generated config (imports torch and "
    "DeepSpeed: ~1.5 s). The test suite runs it on every preset and on random requests.")

def ds_config(
    model: str | None = opt.MODEL_OR_NONE,
    check: Path | None = typer.Option(None, "--check", help="Lint this config instead."),
    world_size: int | None = WORLD_SIZE,
    nodes: int = opt.NODES, gpus_per_node: int = opt.GPUS, gpu_mem: str = opt.GPU_MEM,
    cpu_mem: str = opt.CPU_MEM,
    nvme_path: str | None = typer.Option(None, "--nvme-path"),
    nvme_size: str | None = typer.Option(None, "--nvme-size", help="NVMe space per node."),
    stage: str = typer.Option("auto", "--stage", help="auto, 0, 1, 2 or 3."),
    offload: str = typer.Option("auto", "--offload", help="auto, none, cpu or nvme."),
    tp: int = opt.TP, pp: int = opt.PP, cp: int = opt.CP, ep: int = opt.EP,
    vpp: int | None = opt.VPP,
    sequence_parallel: bool = opt.SP, seq_len: int = opt.SEQ, micro_batch: int = opt.MICRO,
    global_batch: int | None = opt.GLOBAL, dtype: str = opt.DTYPE,
    recompute: str = RECOMPUTE,
    flash: bool = opt.FLASH, dpo: bool = opt.DPO, precompute_reference: bool = opt.PRECOMPUTE_REF,
    gpu: str = GPU, hf_trainer: bool = HF_TRAINER,
    network: str = opt.NETWORK, allow_quantized_comm: bool = opt.ALLOW_QUANTIZED,
    hpz: str = HPZ,
    scheduler: str = typer.Option("WarmupDecayLR", "--scheduler"),
    lr: float = typer.Option(3e-4, "--lr"),
    warmup_steps: int = typer.Option(100, "--warmup-steps"),
    total_steps: int = typer.Option(10000, "--total-steps"),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write the JSON here."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not print the reasoning."),
    deepspeed_parse: bool = DEEPSPEED_PARSE,
    peft: str = opt.PEFT, lora_r: int = opt.LORA_R, lora_targets: str | None = opt.LORA_TARGETS,
) -> None:
    """Choose ZeRO stage, offload and ZeRO++ for MODEL on the cluster, explain why, write the
    config. --check lints a config instead (--world-size and --gpus-per-node sharpen it)."""
    layout = opt.layout_of(tp, pp, cp, ep, vpp, sequence_parallel)
    if check is not None:
        _check(check, world_size, layout, gpus_per_node)
        return
    if model is None:
        fail("give --model (to generate a config) or --check FILE (to lint one).")
    from toolkit.dsconfig import ConfigError, Request, generate
    from toolkit.dsconfig.presets import render, write_json
    from toolkit.memory import TrainShape, dpo_fields, load_model_shape

    auto = recompute == "auto"
    try:
        request = Request(
            model=load_model_shape(model, lora=opt.lora_of(peft, lora_r, lora_targets)),
            cluster=opt.cluster_of(nodes, gpus_per_node, gpu_mem, cpu_mem, nvme_path, nvme_size),
            train=TrainShape(seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch,
                             dtype=dtype, recompute="none" if auto else recompute,
                             flash_attention=flash, **dpo_fields(dpo, precompute_reference)),
            layout=layout, stage=stage, offload=offload, hf_trainer=hf_trainer,
            scheduler=scheduler, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps,
            hpz=_hpz(hpz), allow_quantized_comm=allow_quantized_comm,
        )
        if auto:
            from toolkit.planner import get_device
            from toolkit.planner.devices import network_inter
            from toolkit.planner.zero_auto import zero_auto

            device = get_device(gpu, inter=network_inter(network, gpus_per_node))
            plan = zero_auto(request, device)
        else:
            plan = generate(request)
    except (ConfigError, ValueError) as e:
        fail(str(e))
    if not quiet:
        _explain(plan)
    if deepspeed_parse:  # generate() already ran mdtk's lint; add DeepSpeed's parser
        from toolkit.dsconfig.lint import deepspeed_errors

        errors = deepspeed_errors(plan.config)
        if errors:  # a generator bug: never hand out a config DeepSpeed would refuse
            fail("DeepSpeed's parser refuses the generated config:\n  " + "\n  ".join(errors))
    if output is None:
        typer.echo(render(plan.config), nl=False)
    else:
        write_json(output, plan.config)
        checked = "mdtk's lint and DeepSpeed's parser accept" if deepspeed_parse else \
            "mdtk's lint accepts"
        typer.echo(f"wrote {output} ({checked} it)", err=True)


def _hpz(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        fail(f"--hpz {text!r}: give auto, 1 (off) or a partition size such as 8.")
    return int(text)


def _explain(plan) -> None:
    from toolkit.memory import GIB

    err = typer.echo
    err("Options considered (least communication first; with --recompute auto the fastest "
        "that fits, offload last):", err=True)
    for option in plan.considered:
        mark = "->" if option is plan.chosen else "  "
        err(f" {mark} {option.label}: {option.reason}", err=True)
    chosen = plan.chosen
    print_estimate(chosen.estimate, f"chosen: {chosen.label} (per rank, "
                   f"{chosen.estimate.layout.describe()})")
    for note in plan.notes:
        err(f"note: {note}", err=True)
    costs = getattr(plan, "costs", {})
    if "plain" in costs:
        shown = {"plain ZeRO-3": costs["plain"], "chosen": costs["chosen"]}
        if "quantized" in costs and costs["quantized"] is not costs["chosen"]:
            shown["lossy qwZ/qgZ (best)"] = costs["quantized"]
        print_traffic(shown, "data-parallel traffic per GPU per step, GB (ZeRO-3 collectives, "
                      "docs/planner.md):")
    err(f"GPU total {chosen.estimate.gpu / GIB:.2f} GiB per rank", err=True)


def _check(path: Path, world_size: int | None, layout, gpus_per_node: int) -> None:
    from toolkit.dsconfig import lint, load_config

    try:
        cfg = load_config(path)
    except (OSError, ValueError) as e:
        fail(str(e))
    report = lint(cfg, world_size=world_size, layout=layout, gpus_per_node=gpus_per_node)
    for e in report.errors:
        typer.echo(f"error: {e}")
    for w in report.warnings:
        typer.echo(f"warning: {w}")
    if report.errors:
        raise typer.Exit(1)
    typer.echo(f"{path}: OK ({len(report.warnings)} warnings)")


def register(app: typer.Typer) -> None:
    app.command("ds-config")(ds_config)
