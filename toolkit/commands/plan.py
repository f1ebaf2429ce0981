"""``mdtk plan``: the fastest layouts for a model on a cluster, their time and cost; --emit writes
a runnable trainer YAML + DeepSpeed JSON, --sweep-gpus compares cluster sizes (table + PNG)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer

from toolkit.commands.estimate import CPU_MEM, DTYPE, FLASH, GPUS, NODES, SEQ, fail

_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str | None) -> float | None:
    """'2T', '300B', '1.5e12' -> tokens (decimal suffixes)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMBGT]?)\s*", text.upper())
    if not m:
        raise ValueError(f"cannot read the token count {text!r}: write it like 2T, 300B or 1e12.")
    return float(m.group(1)) * _SCALE[m.group(2)]


def plan_cmd(
    model: str | None = typer.Option(None, "--model", help="Preset name, config.json, folder or "
                                     "hub id."),
    nodes: int = NODES, gpus_per_node: int = GPUS,
    gpu: str = typer.Option("h100", "--gpu", help="Device: h100, h200, a100-80gb, a100-40gb, "
                            "l40s, b200, mi300x, ... (mdtk plan --gpu list shows them)."),
    gpu_mem: str | None = typer.Option(None, "--gpu-mem", help="Memory per GPU (default: the "
                                       "device's)."),
    cpu_mem: str = CPU_MEM, seq_len: int = SEQ,
    global_batch: int | None = typer.Option(None, "--global-batch", min=1, help="Sequences per "
                                            "step (default: ~1M tokens, a multiple of the GPUs)."),
    dtype: str = DTYPE, flash: bool = FLASH,
    tokens: str | None = typer.Option(None, "--tokens", help="Tokens to train, e.g. 2T: time "
                                      "and cost columns."),
    price: float | None = typer.Option(None, "--price-per-gpu-hour", min=0.0,
                                       help="Price of one GPU-hour (cost column)."),
    top: int = typer.Option(5, "--top", min=1, help="Plans to show."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    allow_cp: bool = typer.Option(False, "--allow-cp", help="Also rank context-parallel plans "
                                  "(mdtk's CP attention: all-gather K/V, no Transformer Engine)."),
    per_layout: bool = typer.Option(False, "--per-layout", help="One plan per layout (tp, pp, "
                                    "cp, ep, dp): the best ZeRO/offload/recompute/micro-batch."),
    peak_tflops: float | None = typer.Option(None, "--peak-tflops", min=0.0,
                                             help="Override the device's peak TFLOP/s."),
    intra_gbps: float | None = typer.Option(None, "--intra-gbps", min=0.0,
                                            help="Override the GPU link, GB/s per direction."),
    inter_gbps: float | None = typer.Option(None, "--inter-gbps", min=0.0,
                                            help="Override the network per GPU, GB/s."),
    pcie_gbps: float | None = typer.Option(None, "--pcie-gbps", min=0.0,
                                           help="Override the host link, GB/s."),
    hbm_gbps: float | None = typer.Option(None, "--hbm-gbps", min=0.0,
                                          help="Override the memory bandwidth, GB/s."),
    emit: Path | None = typer.Option(None, "--emit", help="Write train.yaml + ds_config.json of "
                                     "the chosen plan into this folder."),
    emit_rank: int = typer.Option(1, "--emit-rank", min=1, help="Which plan --emit writes."),
    data: list[str] = typer.Option(None, "--data", help="With --emit: training data (repeat)."),
    data_mode: str = typer.Option("pretrain", "--data-mode", help="pretrain or sft."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="With --emit: tokenizer "
                                         "(default: the model folder)."),
    output_dir: str | None = typer.Option(None, "--output-dir", help="With --emit: the run's "
                                          "output_dir (default DIR/run)."),
    steps: int | None = typer.Option(None, "--steps", min=1, help="With --emit: optimizer steps "
                                     "(default: --tokens worth, else 100)."),
    sweep_gpus: str | None = typer.Option(None, "--sweep-gpus", help="Comma-separated GPU "
                                          "counts: best plan, time and cost for each."),
    plot: Path = typer.Option(Path("plan_sweep.png"), "--plot", help="With --sweep-gpus: the "
                              "PNG to write."),
) -> None:
    """Rank layouts (tp, pp, vpp, cp, ep, dp), ZeRO stage, offload, recompute and micro-batch
    by estimated step time among those the memory model says fit."""
    from toolkit.memory import load_model_shape, parse_bytes
    from toolkit.planner import DEVICES, DeviceError, PlanError, get_device
    from toolkit.planner.search import Budget, SearchSpace, layout_key, search

    if gpu == "list":
        for key, d in DEVICES.items():
            typer.echo(f"{key:10s} {d.name}: {d.bf16_tflops:g} TFLOP/s bf16, {d.memory_gib:g} "
                       f"GiB, HBM {d.hbm / 1e9:,.0f} GB/s, link {d.intra / 1e9:g} GB/s, network "
                       f"{d.inter / 1e9:g} GB/s")
        return
    if model is None:
        fail("give --model (a preset, config.json, folder or hub id), or --gpu list.")
    try:
        device = get_device(gpu, bf16_tflops=peak_tflops, fp32_tflops=peak_tflops,
                            intra=_gb(intra_gbps), inter=_gb(inter_gbps), pcie=_gb(pcie_gbps),
                            hbm=_gb(hbm_gbps))
        shape = load_model_shape(model)
        count = parse_count(tokens)
        from toolkit.memory import GIB, Cluster

        cluster = Cluster(nodes=nodes, gpus_per_node=gpus_per_node,
                          gpu_mem=parse_bytes(gpu_mem) if gpu_mem else int(device.memory_gib *
                                                                              GIB),
                          cpu_mem=parse_bytes(cpu_mem))
    except (ValueError, DeviceError) as e:
        fail(str(e))
    on_cpu = device.key == "cpu"  # mdtk's CPU path: megatron-core's unfused kernels, eager
    kernels = {"flash": not on_cpu and flash, "fused": not on_cpu}
    budget = Budget()
    space = SearchSpace(allow_cp=allow_cp)
    if sweep_gpus is not None:
        _sweep(shape, sweep_gpus, cluster, device, seq_len, global_batch, dtype, kernels, count,
               price, space, budget, plot, as_json)
        return
    from toolkit.planner import Workload, default_global_batch

    work = Workload(seq_len, global_batch or default_global_batch(seq_len, cluster.world_size),
                    dtype, **kernels)
    try:
        result = search(shape, work, cluster, device, top=max(top, emit_rank), space=space,
                        budget=budget, group=layout_key if per_layout else None)
    except (PlanError, ValueError) as e:
        fail(str(e))
    if not result.plans:
        fail(f"no plan of {shape.name} fits {cluster.world_size} x {cluster.gpu_mem / GIB:.0f} "
             f"GiB (global batch {work.global_batch}, seq {seq_len}); for example:\n  " +
             "\n  ".join(result.reasons) + "\nTry more GPUs, a shorter --seq-len or a GPU with "
             "more memory.")
    if as_json:
        typer.echo(json.dumps(_json(shape, device, cluster, work, result, count, price),
                              indent=2))
    else:
        _table(shape, device, cluster, work, result, count, price, top)
    if emit is not None:
        _emit(emit, emit_rank, shape, model, work, result, cluster, budget, data, data_mode,
              tokenizer, output_dir, steps, count)


def _gb(value: float | None) -> float | None:
    return None if value is None else value * 1e9


def _json(shape, device, cluster, work, result, tokens, price) -> dict:
    return {
        "model": shape.name, "params": shape.num_params(), "device": device.key,
        "nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
        "seq_len": work.seq_len, "global_batch": work.global_batch, "dtype": work.dtype,
        "tokens": tokens, "price_per_gpu_hour": price,
        "considered": result.considered, "rejected_memory": result.rejected_memory,
        "plans": [p.to_dict(tokens, price) for p in result.plans],
    }


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _duration(hours: float) -> str:
    return f"{hours:,.1f} h" if hours < 48 else f"{hours / 24:,.1f} d"


def _table(shape, device, cluster, work, result, tokens, price, top) -> None:
    from toolkit.planner import explain

    typer.echo(f"{shape.name} ({_params(shape.num_params())} params) on {cluster.nodes} x "
               f"{cluster.gpus_per_node} {device.key}, seq {work.seq_len}, global batch "
               f"{work.global_batch}, {work.dtype}")
    head = ["#", "layout", "ZeRO", "offload", "recompute", "micro x acc", "GiB/GPU", "step s",
            "tok/s/GPU", "MFU"]
    if tokens:
        head += [f"time for {tokens:.3g} tokens", "cost" if price is not None else "GPU-hours"]
    rows = [head]
    for i, p in enumerate(result.plans[:top], 1):
        c, k = p.candidate, p.cost
        layout = f"tp{c.tp} pp{c.pp}" + (f" vpp{c.vpp}" if c.vpp > 1 else "") + (
            f" cp{c.cp}" if c.cp > 1 else "") + (f" ep{c.ep}" if c.ep > 1 else "") + f" dp{c.dp}"
        if not p.runnable:
            layout += " (*)"
        row = [str(i), layout, str(c.zero), c.offload, c.recompute,
               f"{c.micro_batch} x {k.num_microbatches}", f"{p.mem_per_gpu / 2**30:.1f}",
               f"{k.step:.3g}", f"{k.tokens_per_s_per_gpu:,.0f}", f"{k.mfu:.1%}"]
        if tokens:
            d = p.to_dict(tokens, price)
            row += [_duration(d["hours_for_tokens"]),
                    f"{d['cost_for_tokens']:,.0f}" if price is not None else
                    f"{d['gpu_hours_for_tokens']:,.0f}"]
        rows.append(row)
    widths = [max(len(r[j]) for r in rows) for j in range(len(head))]
    for r in rows:
        typer.echo("  ".join(v.ljust(w) if j in (1, 3, 4) else v.rjust(w)
                             for j, (v, w) in enumerate(zip(r, widths, strict=True))))
    best = result.plans[0]
    typer.echo(f"#1 step: {_breakdown(best)}")
    for i, other in enumerate(result.plans[1:top], 2):
        typer.echo(f"  #1 over #{i}: {explain(best, other)}")
    typer.echo(f"({result.considered} plans costed, {result.rejected_memory} refused by the "
               "memory model before these fitted; how the estimate works: docs/planner.md)")
    for p in result.plans[:top]:
        if p.note:
            typer.echo(f"(*) {p.note}")
            break


def _breakdown(p) -> str:
    parts = [f"{k.replace('_', ' ')} {v:.3g}" for k, v in p.cost.breakdown().items() if v > 0]
    return ", ".join(parts) + " s"


def _emit(folder: Path, rank: int, shape, model_arg: str, work, result, cluster, budget,
          data, data_mode, tokenizer, output_dir, steps, tokens) -> None:
    import yaml

    from toolkit.atomic import write_text
    from toolkit.dsconfig import lint, write_json
    from toolkit.planner.emit import EmitError, RunSpec, deepspeed_json, steps_for, trainer_yaml
    from toolkit.train.config import ConfigError, config_from_dict

    if rank > len(result.plans):
        fail(f"--emit-rank {rank}: only {len(result.plans)} plans fit.")
    plan = result.plans[rank - 1]
    folder.mkdir(parents=True, exist_ok=True)
    model_path, model_config = _model_source(model_arg, folder)
    run = RunSpec(output_dir=output_dir or str((folder / "run").resolve()), model_path=model_path,
                  model_config=model_config, tokenizer=tokenizer, data=tuple(data or ()),
                  data_mode=data_mode, steps=steps or steps_for(tokens, work))
    if model_config and not tokenizer:
        fail(f"--model {model_arg} is a config without weights (pretraining from scratch): "
             "give --tokenizer (a tokenizer folder or hub id).")
    ds_path = (folder / "ds_config.json").resolve()
    try:
        ds_config, notes = deepspeed_json(shape, work, plan, cluster, budget)
        raw = trainer_yaml(plan, work, run, str(ds_path))
    except EmitError as e:
        fail(str(e))
    report = lint(ds_config, world_size=cluster.world_size, layout=plan.candidate.layout())
    if report.errors:
        fail("the emitted DeepSpeed config failed the lint:\n  " + "\n  ".join(report.errors))
    write_json(ds_path, ds_config)
    try:
        config_from_dict(raw)  # the trainer's own schema and cross-key checks
    except ConfigError as e:
        fail(str(e))
    write_text(folder / "train.yaml", yaml.safe_dump(raw, sort_keys=False))
    n = cluster.gpus_per_node
    launch = f"mdtk launch -n {n}" + (f" --nnodes {cluster.nodes} --node-rank $NODE_RANK "
                                      "--master-addr $MASTER_ADDR" if cluster.nodes > 1 else "")
    typer.echo(f"wrote {folder / 'train.yaml'} and {ds_path} ({plan.candidate.describe()})",
               err=True)
    typer.echo(f"run it with: {launch} -- train {folder / 'train.yaml'}", err=True)
    for note in notes:
        typer.echo(f"note: {note}", err=True)


def _model_source(model_arg: str, folder: Path) -> tuple[str | None, str | None]:
    """(model.path, model.config): a folder with weights is fine-tuned; a preset or a bare
    config.json is pretrained from its config (presets are written next to the YAML)."""
    path = Path(model_arg)
    if path.is_dir() and any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
        return str(path.resolve()), None
    if path.is_dir():
        return None, str((path / "config.json").resolve())
    if path.is_file():
        return None, str(path.resolve())
    from toolkit.adapters.presets import MODEL_PRESETS, get_preset

    if model_arg.lower() in MODEL_PRESETS:
        from toolkit.atomic import write_text

        target = folder / "model_config.json"
        write_text(target, json.dumps(get_preset(model_arg), indent=2))
        return None, str(target.resolve())
    return model_arg, None  # a hub id: fine-tune it


def _sweep(shape, counts_text, cluster, device, seq_len, global_batch, dtype, kernels, tokens,
           price, space, budget, plot, as_json) -> None:
    from toolkit.planner import Workload
    from toolkit.planner.sweep import figure, marks, sweep, sweep_global_batch

    try:
        counts = sorted({int(x) for x in counts_text.split(",") if x.strip()})
    except ValueError:
        fail(f"--sweep-gpus {counts_text!r}: give GPU counts like 8,16,32,64.")
    if not counts or min(counts) < 1:
        fail("--sweep-gpus needs positive GPU counts, e.g. 8,16,32,64.")
    if not tokens:
        fail("--sweep-gpus needs --tokens (the time and cost to train that many tokens).")
    work = Workload(seq_len, global_batch or sweep_global_batch(seq_len, counts), dtype,
                    **kernels)
    try:
        rows = sweep(shape, work, counts, cluster, device, tokens, price, space, budget)
    except ValueError as e:
        fail(str(e))
    fastest, cheapest = marks(rows)
    unit = "cost" if price is not None else "GPU-hours"
    if as_json:
        typer.echo(json.dumps({
            "model": shape.name, "device": device.key, "seq_len": seq_len,
            "global_batch": work.global_batch, "tokens": tokens, "price_per_gpu_hour": price,
            "fastest_gpus": fastest, "cheapest_gpus": cheapest,
            "rows": [{"gpus": r.gpus, "hours": r.hours, unit.replace("-", "_").lower(): r.cost,
                      "plan": r.plan.to_dict(tokens, price) if r.plan else None,
                      "reason": r.reason or None} for r in rows]}, indent=2))
    else:
        typer.echo(f"{shape.name}, {tokens:.3g} tokens, seq {seq_len}, global batch "
                   f"{work.global_batch}, {device.key}:")
        for r in rows:
            if r.plan is None:
                typer.echo(f"  {r.gpus:6d} GPUs: nothing fits ({r.reason})")
                continue
            tag = "".join([" <- fastest" if r.gpus == fastest else "",
                           " <- cheapest" if r.gpus == cheapest else ""])
            typer.echo(f"  {r.gpus:6d} GPUs: {_duration(r.hours):>9s}, {unit} {r.cost:,.0f}, "
                       f"{r.plan.cost.tokens_per_s_per_gpu:,.0f} tok/s/GPU, MFU "
                       f"{r.plan.cost.mfu:.1%}, {r.plan.candidate.describe()}{tag}")
    if not any(r.plan for r in rows):
        fail("nothing fits at any GPU count.")
    try:
        fig = figure(rows, f"{shape.name}: {tokens:.3g} tokens on {device.key}",
                     price is not None)
    except ImportError as e:
        typer.echo(f"note: no plot: {e}", err=True)
        return
    import io

    from toolkit.atomic import write_bytes

    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_bytes(plot, png.getvalue())
    typer.echo(f"wrote {plot}", err=True)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
