"""The built-in demo: the whole story on CPU in a few minutes.

1. build a tiny HF Llama checkpoint (real transformers class, random weights) and a tokenizer;
2. fine-tune it with ``bundled:examples/sft_tiny.yaml`` (the SFT data shipped inside mdtk) on 2
   gloo ranks (dp=2, ZeRO-2 chosen and explained by the DeepSpeed config generator) through
   `torchrun ... mdtk train`;
3. export the result to an HF folder and check its logits against the trained model;
4. report the loss curve and the validation loss before/after.

Everything it writes goes under ``out`` (``mdtk demo --out``, default ``build/demo`` in the
current folder); it reads only files shipped inside the package, so it runs from any folder.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit import bundled
from toolkit.adapters.spec import ModelSpec, has_config, read_hf_config
from toolkit.atomic import building


@dataclass
class DemoResult:
    first_loss: float
    last_loss: float
    val_losses: dict[int, float]
    export_dir: Path
    export_max_abs_diff: float | None


def make_tiny_checkpoint(out: Path, *, seed: int = 0,
                         overrides: dict[str, Any] | None = None) -> Path:
    """A tiny Llama (bundled:examples/tiny_llama_config.json, ``overrides`` on top) with random
    weights + the tokenizer (of the config's vocab size)."""
    from toolkit import runtime

    runtime.select_deepspeed_accelerator()  # transformers imports DeepSpeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    if has_config(out) and (out / "tokenizer.json").is_file():
        return out
    hf_logging.disable_progress_bar()  # "Writing model shards" for one small file
    with building(out) as tmp:  # replaces an incomplete earlier attempt
        raw = {**read_hf_config(bundled.path(bundled.TINY_LLAMA_CONFIG)).to_dict(),
               **(overrides or {})}
        build_tiny_tokenizer(tmp, vocab_size=raw["vocab_size"])
        config = ModelSpec.of(raw, live=True).transformers_config()
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
    return out


def describe_model(model_dir: Path) -> str:
    """One line for the story: what the model is and where it lives."""
    c = read_hf_config(model_dir).to_dict()
    return (f"model: tiny {c['model_type'].capitalize()} ({c['num_hidden_layers']} layers, hidden "
            f"{c['hidden_size']}, {c['num_attention_heads']} heads / {c['num_key_value_heads']} "
            f"kv, vocab {c['vocab_size']}; random weights) at {model_dir}")


def run_demo(out: Path, *, nproc: int = 2, steps: int | None = None,
             extra: list[str] | None = None, log: Callable[[str], None] = print) -> DemoResult:
    from toolkit.launch import LaunchSpec, run_local
    from toolkit.runtime.ports import free_port
    from toolkit.train.loop.metrics import read_metrics

    model_dir = make_tiny_checkpoint(out / "tiny-llama")
    log(describe_model(model_dir))
    log(f"fine-tuning it on {nproc} gloo ranks with {bundled.SFT_EXAMPLE} (bundled SFT data)")
    run_dir = out / "sft"
    args = ["train", bundled.SFT_EXAMPLE, f"output_dir={run_dir}", f"model.path={model_dir}",
            f"export.hf_dir={run_dir / 'hf'}", "checkpoint.resume=none"]
    if steps is not None:
        args.append(f"train.steps={steps}")
    args += extra or []
    spec = LaunchSpec(nproc, master_port=free_port())
    if run_local(spec, args) != 0:
        raise RuntimeError("training failed (see the log above)")
    rows = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    vals = {int(k): v for k, v in summary["val_losses"].items()}
    return DemoResult(rows[0]["loss"], rows[-1]["loss"], vals, run_dir / "hf",
                      summary.get("export_max_abs_diff"))
