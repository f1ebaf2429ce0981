"""The GPU check's report: each part's figures as Markdown lines (one formatter per part), the
whole run's summary, and its entry in docs/benchmarks.md (``scripts/gpu_check.py --record``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
RUN = "### GPU check, "  # each recorded run's heading


def _versions(name: str, fig: dict) -> list[str]:
    pk = fig["packages"]
    return [f"- **versions**: {fig.get('device')}, CUDA {fig.get('cuda')}, Python "
            f"{fig['python']}; " + ", ".join(f"{k} {v}" for k, v in pk.items() if v)
            + ("; not installed: " + ", ".join(k for k, v in pk.items() if not v))
            + (f"; differ from the lock: {fig['lock_mismatches']}"
               if fig.get("lock_mismatches") else "")]


def _gpu_tests(name: str, fig: dict) -> list[str]:
    lines = [f"- **gpu_tests**: {fig['tests']} tests, {fig['failures']} failed, "
             f"{fig['errors']} errors, {fig['skipped']} skipped"]
    return lines + [f"  - `{t}`: {v['outcome'].splitlines()[0]} ({v['s']:.0f} s)"
                    for t, v in fig["cases"].items()]


def _train(name: str, fig: dict) -> list[str]:
    g = fig["gpu"]
    mfu = f"{100 * g['mfu']:.1f}%" if g.get("mfu") is not None else "n/a"
    return [f"- **{name}** (seq {g['seq']}, micro {g['micro_batch']} x "
            f"{g['accumulation']}, ZeRO-{g.get('zero', 1)}, kernels {g.get('kernels', '-')}"
            f"): trainer {g['tokens_per_s']:,.0f} tokens/s, MFU {mfu}; "
            f"bare megatron-core {1e3 * g['bare_s']:.1f} ms/step, trainer "
            f"{1e3 * g['trainer_s']:.1f} ms/step: overhead {g['overhead_pct']:+.1f}% "
            f"(trainer/bare {g['trainer_s'] / g['bare_s']:.3f}); peak "
            f"{g['peak_gib']:.1f} GiB"]


def _attention(name: str, fig: dict) -> list[str]:
    lines = [f"- **attention** ({fig['dtype']}, {fig['heads']}/{fig['groups']} heads x "
             f"{fig['dim']}, fwd+bwd, median ms; speed-up vs megatron-core local):"]
    for r in fig["results"]:
        fast = r.get("speedup_vs_local", {})  # none where the local path ran out of memory
        cells = [f"{k} {v:.2f} ms (" + (f"{fast[k]:.1f}x, " if k in fast else "")
                 + f"{r['peak_gib'].get(k, 0):.1f} GiB)" for k, v in r["ms"].items()]
        cells += [f"{k} OOM" for k in r["oom"]]
        lines.append(f"  - {r['seq']} tokens: " + "; ".join(cells))
    return lines


def _kernels(name: str, fig: dict) -> list[str]:
    lines = [f"- **kernels** ({fig['device']}, bf16, fwd+bwd, median ms; x the local "
             "spec's; peak GiB; max error vs fp32, relative):"]
    for op, variants in fig["ops"].items():
        cells = [f"{k} " + (v["error"] if "error" in v else
                            f"{v['ms']:.2f} ms (x{v['over_local']:.2f}, {v['peak_gib']:.2f} "
                            f"GiB, err {v['max_rel_error']:.1e})")
                 for k, v in variants.items()]
        lines.append(f"  - {op}: " + "; ".join(cells))
    return lines


def _planner(name: str, fig: dict) -> list[str]:
    return [f"- **planner**: predicted {fig['predicted_s'] * 1e3:.1f} ms/step vs measured "
            f"{fig['measured_s'] * 1e3:.1f} (train_step): ratio "
            f"{fig['predicted_over_measured']:.2f}, predicted MFU "
            f"{100 * fig['predicted_mfu']:.1f}% ({fig['device_table']})"]


def _lora(name: str, fig: dict) -> list[str]:
    g, m = fig["gpu"], fig["gpu"]["model"]

    def cell(key: str, unit: float, fmt: str) -> str:
        v = g[key]
        return f"{v['lora_over_full']:.3f} ({v['lora'] / unit:{fmt}} vs {v['full'] / unit:{fmt}})"
    return [f"- **lora** (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, seq "
            f"{g['seq']}, micro {g['micro_batch']}; LoRA/full): step time "
            f"{cell('step_s', 1e-3, '.1f')} ms, bytes held by the engine "
            f"{cell('held_bytes', 2**30, '.2f')} GiB, peak {cell('peak', 2**30, '.2f')} GiB, "
            f"trainable {cell('trainable', 1, ',.0f')}"]


def _indexed_data(name: str, fig: dict) -> list[str]:
    t, losses = fig["train"], fig["losses"]
    return [f"- **indexed_data** (blend {fig['weights']}, {t['steps']} steps, global batch "
            f"{t['global_batch']} x {t['seq_len']}, {t['precision']}): "
            f"{fig['tokens_per_s']:,.0f} tokens/s, data set-up {fig['data_s']:.2f} s, first "
            f"source's share {fig['share_first_source']:.3f}, loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}"]


def _zeropp(name: str, fig: dict) -> list[str]:
    cells = [f"{k} " + (v["error"] if "error" in v else
                        f"{v['median_ms']:.3f} ms (x{v['ratio_vs_copy']:.2f} of a copy, "
                        f"{v['achieved_gbs_at_modelled_bytes']:,.0f} GB/s at "
                        f"{v['modelled_bytes_per_element']:g} B/element modelled, relative "
                        f"error {v['relative_error']:.4f})")
             for k, v in fig["kernels"].items()]
    return [f"- **zeropp** ({fig['rows']} x {fig['cols']} bf16; op load {fig['load_s']} s): "
            + "; ".join(cells)]


def _checkpoint(name: str, fig: dict) -> list[str]:
    med = {k: v["median"] for k, v in fig["stats"].items()}
    differ = fig.get("async_files_differing")
    lines = [f"- **checkpoint** ({fig['layers']} layer(s), {fig['checkpoint_bytes'] / 1e9:.2f}"
             f" GB, {fig['rounds']} round(s), median s): DeepSpeed save {med['deepspeed_s']:.2f}"
             f" (+ fsync and hash {med['deepspeed_fsync_hash_s']:.2f}), mdtk sync "
             f"{med['sync_s']:.2f}, async stall {med['async_stall_s']:.3f} (x"
             f"{fig['stall_over_sync']:.3f} of sync; written in {med['async_total_s']:.2f}); "
             f"async files identical to sync: {fig['async_files_identical_to_sync']}"
             + (f" (differing: {', '.join(differ)})" if differ else "")
             + (f"; with no step during the write: "
                f"{fig['async_files_identical_to_sync_without_steps']}"
                if "async_files_identical_to_sync_without_steps" in fig else "")]
    why = {**fig.get("async_files_differing_why", {}),
           **{f"{k} (no steps)": v for k, v in
              (fig.get("async_files_differing_without_steps") or {}).items() if v}}
    return lines + [f"  - why `{f}`: {json.dumps(v)[:600]}" for f, v in why.items()]


#: part name (or prefix, ending in "*") -> its formatter; (a part's own test of its figures)
FORMATS: dict[str, tuple[Callable[[str, dict], list[str]], Callable[[dict], bool]]] = {
    "versions": (_versions, lambda f: True), "gpu_tests": (_gpu_tests, lambda f: True),
    "train_mfu*": (_train, lambda f: True), "attention": (_attention, lambda f: True),
    "kernels": (_kernels, lambda f: bool(f.get("ops"))), "planner": (_planner, lambda f: True),
    "lora": (_lora, lambda f: True), "indexed_data": (_indexed_data, lambda f: True),
    "zeropp": (_zeropp, lambda f: bool(f.get("available"))),
    "checkpoint": (_checkpoint, lambda f: True),
}


def format_part(name: str, rec: dict) -> list[str]:
    """A part's record as Markdown lines (its figures, or why there are none)."""
    fig = rec.get("figures") or {}
    if rec.get("status") != "ok":
        why = rec.get("error") or f"exit {rec.get('rc')}"
        return [f"- **{name}**: {rec.get('status')}: {why}"]
    key = name if name in FORMATS else next(
        (k for k in FORMATS if k.endswith("*") and name.startswith(k[:-1])), None)
    if key is not None and FORMATS[key][1](fig):
        return FORMATS[key][0](name, fig)
    return [f"- **{name}**: " + "; ".join(f"{k} {v}" for k, v in _flat(fig))[:900]]


def _flat(fig: dict, prefix: str = "") -> list[tuple[str, str]]:
    """A part's figures as short `key value` pairs (long lists cut to their ends)."""
    out: list[tuple[str, str]] = []
    for k, v in fig.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        elif isinstance(v, float):
            out.append((f"{prefix}{k}", f"{v:.4g}"))
        elif isinstance(v, list) and len(v) > 4:
            out.append((f"{prefix}{k}", f"[{v[0]:.4g} .. {v[-1]:.4g}] ({len(v)})"
                        if all(isinstance(x, float) for x in v) else f"({len(v)} items)"))
        else:
            out.append((f"{prefix}{k}", str(v)))
    return out


def markdown(report: dict) -> str:
    devices = [(rec.get("figures") or {}).get("device") for rec in report["parts"].values()
               if isinstance(rec.get("figures"), dict)]  # versions' first; a part's otherwise
    device = next((d for d in devices if d), None)
    lines = [f"### GPU check, {report['date']}, {device or 'device unknown'}", "",
             "```bash", "python scripts/gpu_check.py OUT --wheels .whl"
             + (f" --only {','.join(report['only'])}" if report.get("only") else "")
             + f" --budget {report['budget_s']:.0f}   # make gpu-check", "```",
             "", f"Wall time {report.get('wall_s', 0):.0f} s of a {report['budget_s']:.0f} s "
             "budget; each part's peak is the device memory in use while it ran.", ""]
    if report.get("torch_cuda_arch_list"):
        arch = report["torch_cuda_arch_list"]
        lines += [f"DeepSpeed's CUDA ops built for TORCH_CUDA_ARCH_LIST={arch['used']!r} "
                  f"(the image's: {arch['image']!r}).", ""]
    for name, rec in report["parts"].items():
        try:
            lines += format_part(name, rec)
        except (KeyError, TypeError, ValueError) as e:  # a part's figures in an odd shape
            lines.append(f"- **{name}**: {rec.get('status')} (summary failed: {e!r}): "
                         f"{json.dumps(rec.get('figures'))[:600]}")
        if "peak_device_mib" in rec and rec.get("status") == "ok":
            lines[-1] += f" [{rec['s']:.0f} s, device peak {rec['peak_device_mib'] / 1024:.1f} GiB]"
    return "\n".join(lines) + "\n"


def record(json_path: Path, docs: Path = BENCHMARKS) -> None:
    """Put the check's Markdown into docs/benchmarks.md between the gpu-check markers, newest
    first: earlier runs stay (GPU windows are rare; a later run may cover only some parts),
    a run recorded again replaces its own entry."""
    text = docs.read_text()
    block = markdown(json.loads(json_path.read_text()))
    if BEGIN not in text:
        text += f"\n## GPU check (`scripts/gpu_check.py`)\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    runs, tail = rest.split(END, 1)
    heading = block.splitlines()[0]
    kept = [f"{RUN}{r}" for r in runs.split(RUN)[1:] if f"{RUN}{r}".splitlines()[0] != heading]
    docs.write_text(f"{head}{BEGIN}\n{block}{''.join(kept)}{END}{tail}")
