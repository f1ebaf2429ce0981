"""``mdtk plan``: the fastest layouts for a model on a cluster, their time and cost; --emit writes
a runnable trainer YAML + DeepSpeed JSON, --sweep-gpus compares cluster sizes (table + PNG).
The work is ``toolkit.planner.report`` (plan_layouts, sweep_gpus) and
``toolkit.planner.emit.emit``; this module parses and prints."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from toolkit.commands.options import (
    ALLOW_QUANTIZED,
    AS_JSON,
    CPU_MEM,
    DPO,
    DTYPE,
    FLASH,
    GPUS,
    GRPO,
    GRPO_REF,
    GRPO_VLLM,
    LORA_R,
    LORA_TARGETS,
    MODEL_OR_NONE,
    NETWORK,
    NODES,
    PEFT,
    PRECOMPUTE_REF,
    SEQ,
    lora_of,
)
from toolkit.commands.printing import fail, print_traffic

GPU = typer.Option("h100", "--gpu", help="Device: h100, h200, a100-80gb, a100-40gb, l40s, b200, "
                   "mi300x, ... (mdtk plan --gpu list shows them).")
GPU_MEM = typer.Option(None, "--gpu-mem", help="Memory per GPU (default: the device's).")
GLOBAL = typer.Option(None, "--global-batch", min=1, help="Sequences per step (default: ~1M "
                      "tokens, a multiple of the GPUs).")
TOKENS = typer.Option(None, "--tokens", help="Tokens to train, e.g. 2T: time and cost columns.")
PRICE = typer.Option(None, "--price-per-gpu-hour", min=0.0,
                     help="Price of one GPU-hour (cost column).")
TOP = typer.Option(5, "--top", min=1, help="Plans to show.")
ALLOW_CP = typer.Option(False, "--allow-cp", help="Also rank context-parallel plans (mdtk's CP "
                        "attention: all-gather K/V, no Transformer Engine).")
PER_LAYOUT = typer.Option(False, "--per-layout", help="One plan per layout (tp, pp, cp, ep, dp): "
                          "the best ZeRO/offload/recompute/micro-batch.")
PEAK = typer.Option(None, "--peak-tflops", min=0.0, help="Override the device's peak TFLOP/s.")
INTRA = typer.Option(None, "--intra-gbps", min=0.0,
                     help="Override the GPU link, GB/s per direction.")
INTER = typer.Option(None, "--inter-gbps", min=0.0, help="Override the network per GPU, GB/s.")
PCIE = typer.Option(None, "--pcie-gbps", min=0.0, help="Override the host link, GB/s.")
HBM = typer.Option(None, "--hbm-gbps", min=0.0, help="Override the memory bandwidth, GB/s.")
EMIT = typer.Option(None, "--emit", help="Write train.yaml + ds_config.json of the chosen plan "
                    "into this folder.")
EMIT_RANK = typer.Option(1, "--emit-rank", min=1, help="Which plan --emit writes.")
DATA = typer.Option(None, "--data", help="With --emit: training data (repeat).")
DATA_MODE = typer.Option("pretrain", "--data-mode", help="pretrain or sft (--dpo: dpo).")
TOKENIZER = typer.Option(None, "--tokenizer", help="With --emit: tokenizer (default: the model "
                         "folder).")
OUTPUT_DIR = typer.Option(None, "--output-dir", help="With --emit: the run's output_dir (default "
                          "DIR/run).")
STEPS = typer.Option(None, "--steps", min=1, help="With --emit: optimizer steps (default: "
                     "--tokens worth, else 100).")
SWEEP = typer.Option(None, "--sweep-gpus", help="Comma-separated GPU counts: best plan, time and "
                     "cost for each.")
PLOT = typer.Option(Path("plan_sweep.png"), "--plot", help="With --sweep-gpus: the PNG to write.")


def plan_cmd(
    model: str | None = MODEL_OR_NONE, nodes: int = NODES, gpus_per_node: int = GPUS,
    gpu: str = GPU, gpu_mem: str | None = GPU_MEM, cpu_mem: str = CPU_MEM, seq_len: int = SEQ,
    global_batch: int | None = GLOBAL, dtype: str = DTYPE, flash: bool = FLASH,
    tokens: str | None = TOKENS, price: float | None = PRICE, top: int = TOP,
    as_json: bool = AS_JSON, allow_cp: bool = ALLOW_CP, per_layout: bool = PER_LAYOUT,
    peak_tflops: float | None = PEAK, intra_gbps: float | None = INTRA,
    inter_gbps: float | None = INTER, pcie_gbps: float | None = PCIE,
    hbm_gbps: float | None = HBM, emit: Path | None = EMIT, emit_rank: int = EMIT_RANK,
    data: list[str] = DATA, data_mode: str = DATA_MODE, tokenizer: str | None = TOKENIZER,
    output_dir: str | None = OUTPUT_DIR, steps: int | None = STEPS,
    sweep_gpus: str | None = SWEEP, plot: Path = PLOT, dpo: bool = DPO,
    precompute_reference: bool = PRECOMPUTE_REF, grpo: bool = GRPO,
    grpo_reference: bool = GRPO_REF, grpo_vllm: float | None = GRPO_VLLM,
    peft: str = PEFT, lora_r: int = LORA_R,
    lora_targets: str | None = LORA_TARGETS,
    network: str = NETWORK, allow_quantized_comm: bool = ALLOW_QUANTIZED,
) -> None:
    """Rank layouts (tp, pp, vpp, cp, ep, dp), ZeRO stage, offload, recompute and micro-batch
    by estimated step time among those the memory model says fit."""
    from toolkit.planner.report import PlanRequest, plan_layouts
    from toolkit.planner.report import sweep_gpus as sweep_counts

    if gpu == "list":
        _list_devices()
        return
    if model is None:
        fail("give --model (a preset, config.json, folder or hub id), or --gpu list.")
    overrides = {"bf16_tflops": peak_tflops, "fp32_tflops": peak_tflops, "intra": _gb(intra_gbps),
                 "inter": _gb(inter_gbps), "pcie": _gb(pcie_gbps), "hbm": _gb(hbm_gbps)}
    request = PlanRequest(
        model, tokens, price, gpu, gpu_mem, nodes=nodes, gpus_per_node=gpus_per_node,
        cpu_mem=cpu_mem, seq_len=seq_len, global_batch=global_batch, dtype=dtype, flash=flash,
        top=top, allow_cp=allow_cp, network=network, allow_quantized=allow_quantized_comm,
        per_layout=per_layout, emit_rank=emit_rank, dpo=dpo,
        precompute_reference=precompute_reference, grpo=grpo, grpo_reference=grpo_reference,
        grpo_vllm=grpo_vllm, device_overrides=overrides,
        lora=lora_of(peft, lora_r, lora_targets))
    if sweep_gpus is not None:
        try:
            report = sweep_counts(request, sweep_gpus)
        except ValueError as e:
            fail(str(e))
        _print_sweep(report, as_json, plot)
        return
    try:
        report = plan_layouts(request)
    except ValueError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _table(report, top)
    if emit is not None:
        _emit(report, emit, model, emit_rank, data, data_mode, tokenizer, output_dir, steps)


def _gb(value: float | None) -> float | None:
    return None if value is None else value * 1e9


def _list_devices() -> None:
    from toolkit.planner import DEVICES

    for key, d in DEVICES.items():
        typer.echo(f"{key:10s} {d.name}: {d.bf16_tflops:g} TFLOP/s bf16, {d.memory_gib:g} "
                   f"GiB, HBM {d.hbm / 1e9:,.0f} GB/s, link {d.intra / 1e9:g} GB/s, network "
                   f"{d.inter / 1e9:g} GB/s")


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _duration(hours: float) -> str:
    return f"{hours:,.1f} h" if hours < 48 else f"{hours / 24:,.1f} d"


def _vllm_lines(report) -> None:
    """--grpo-vllm: the share kept free, and vLLM's fit per engine tensor-parallel size (1, 2,
    4, ... up to a node, dividing the heads)."""
    from toolkit.memory import vllm_fits, vllm_reserve

    s, share = report.setting, report.setting.vllm_share
    typer.echo(f"vLLM's share kept free on every GPU: "
               f"{vllm_reserve(share, s.cluster.gpu_mem) / 2**30:.1f} GiB")
    sizes = tuple(t for t in (1, 2, 4, 8, 16) if t <= s.cluster.gpus_per_node
                  and s.shape.heads % t == 0)
    fits = vllm_fits(s.shape, share, s.cluster.gpu_mem, report.work.dtype, sizes)
    typer.echo("vLLM engine per grpo.vllm_tensor_parallel_size (weights per GPU, its KV cache in "
               "the rest of the share): " + "; ".join(
                   f"{f.tp}: {f.weights / 2**30:.1f} GiB, "
                   + (f"{f.kv_tokens:,} tokens" if f.fits else "does not fit") for f in fits))


def _table(report, top: int) -> None:
    from toolkit.planner import explain

    s, work, result = report.setting, report.work, report.result
    shape, cluster, tokens, price = s.shape, s.cluster, s.tokens, report.price
    lora = f", {_params(shape.trainable_params())} trainable" if shape.lora else ""
    typer.echo(f"{shape.name} ({_params(shape.num_params())} params{lora}) on {cluster.nodes} x "
               f"{cluster.gpus_per_node} {s.device.key}, seq {work.seq_len}, global batch "
               f"{work.global_batch}, {work.dtype}")
    if s.vllm_share is not None:  # --grpo-vllm: the trainer's share is smaller
        _vllm_lines(report)
    head = ["#", "layout", "ZeRO", "offload", "recompute", "micro x acc", "GiB/GPU", "step s",
            "tok/s/GPU", "MFU"]
    if tokens:
        head += [f"time for {tokens:.3g} tokens", "cost" if price is not None else "GPU-hours"]
    rows = [head] + [_row(i, p, tokens, price) for i, p in enumerate(result.plans[:top], 1)]
    widths = [max(len(r[j]) for r in rows) for j in range(len(head))]
    for r in rows:
        typer.echo("  ".join(v.ljust(w) if j in (1, 3, 4) else v.rjust(w)
                             for j, (v, w) in enumerate(zip(r, widths, strict=True))))
    best = result.plans[0]
    typer.echo(f"#1 step: {_breakdown(best)}")
    from toolkit.planner.report import traffic_comparison

    costs = traffic_comparison(report)
    if costs:
        print_traffic(costs, "#1's data-parallel traffic per GPU per step, GB (ZeRO-3 "
                      "collectives; ZeRO++: docs/planner.md):")
    for i, other in enumerate(result.plans[1:top], 2):
        typer.echo(f"  #1 over #{i}: {explain(best, other)}")
    typer.echo(f"({result.considered} plans costed, {result.rejected_memory} refused by the "
               "memory model before these fitted; how the estimate works: docs/planner.md)")
    for p in result.plans[:top]:
        if p.note:
            typer.echo(f"(*) {p.note}")
            break


def _row(i: int, p, tokens: float | None, price: float | None) -> list[str]:
    c, k = p.candidate, p.cost
    layout = f"tp{c.tp} pp{c.pp}" + (f" vpp{c.vpp}" if c.vpp > 1 else "") + (
        f" cp{c.cp}" if c.cp > 1 else "") + (f" ep{c.ep}" if c.ep > 1 else "") + f" dp{c.dp}"
    if not p.runnable:
        layout += " (*)"
    zero = str(c.zero) + "".join([f"+hpZ{c.hpz}"] * (c.hpz > 1) + ["+qwZ"] * c.qwz
                                 + ["+qgZ"] * c.qgz)
    row = [str(i), layout, zero, c.offload, c.recompute,
           f"{c.micro_batch} x {k.num_microbatches}", f"{p.mem_per_gpu / 2**30:.1f}",
           f"{k.step:.3g}", f"{k.tokens_per_s_per_gpu:,.0f}", f"{k.mfu:.1%}"]
    if tokens:
        d = p.to_dict(tokens, price)
        row += [_duration(d["hours_for_tokens"]),
                f"{d['cost_for_tokens']:,.0f}" if price is not None else
                f"{d['gpu_hours_for_tokens']:,.0f}"]
    return row


def _breakdown(p) -> str:
    parts = [f"{k.replace('_', ' ')} {v:.3g}" for k, v in p.cost.breakdown().items() if v > 0]
    return ", ".join(parts) + " s"


def _emit(report, folder: Path, model_arg: str, rank: int, data, data_mode, tokenizer,
          output_dir, steps) -> None:
    from toolkit.errors import ConfigError
    from toolkit.planner.emit import EmitError, emit
    from toolkit.train.config import config_from_dict

    try:
        out = emit(report, folder, model_arg, rank=rank, data=data or (), data_mode=data_mode,
                   tokenizer=tokenizer, output_dir=output_dir, steps=steps,
                   check=config_from_dict)
    except (EmitError, ConfigError) as e:
        fail(str(e))
    typer.echo(f"wrote {out.yaml_path} and {out.ds_path} ({out.plan.candidate.describe()})",
               err=True)
    typer.echo(f"run it with: {out.launch} -- train {out.yaml_path}", err=True)
    for note in out.notes:
        typer.echo(f"note: {note}", err=True)


def _print_sweep(report, as_json: bool, plot: Path) -> None:
    from toolkit.planner.sweep import marks

    s, rows, tokens = report.setting, report.rows, report.tokens
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        fastest, cheapest = marks(rows)
        typer.echo(f"{s.shape.name}, {tokens:.3g} tokens, seq {report.work.seq_len}, global "
                   f"batch {report.work.global_batch}, {s.device.key}:")
        for r in rows:
            if r.plan is None:
                typer.echo(f"  {r.gpus:6d} GPUs: nothing fits ({r.reason})")
                continue
            tag = "".join([" <- fastest" if r.gpus == fastest else "",
                           " <- cheapest" if r.gpus == cheapest else ""])
            typer.echo(f"  {r.gpus:6d} GPUs: {_duration(r.hours):>9s}, {report.unit} "
                       f"{r.cost:,.0f}, {r.plan.cost.tokens_per_s_per_gpu:,.0f} tok/s/GPU, MFU "
                       f"{r.plan.cost.mfu:.1%}, {r.plan.candidate.describe()}{tag}")
    if not any(r.plan for r in rows):
        fail("nothing fits at any GPU count.")
    try:
        report.save_figure(plot)
    except ImportError as e:
        typer.echo(f"note: no plot: {e}", err=True)
        return
    typer.echo(f"wrote {plot}", err=True)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
