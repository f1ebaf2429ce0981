"""LoRA / DoRA adapters of a training run, as HF PEFT folders or merged into their base model.

A source is an HF PEFT folder, a trainer checkpoint (``step_*``: its ``adapter/`` folder, with
the base model its run recorded) or a checkpoint root (its latest step). ``--to hf-peft`` writes
the PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``); ``--to hf
--merge-lora`` the base with the adapters merged in float32, saved in the base's dtype.
Outputs are written into a temporary sibling and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from toolkit.adapters.spec import has_config
from toolkit.atomic import building
from toolkit.checkpoint.deepspeed import STATE_FILE
from toolkit.lora import LoraError
from toolkit.lora.peft_io import CHECKPOINT_ADAPTER, CONFIG, WEIGHTS, read_config, split_name

LATEST = "latest"  # a checkpoint root's pointer to its newest step_* folder


def find_adapter(src: str | Path) -> tuple[Path, str | None]:
    """(PEFT folder, the base model it was trained on, when recorded) of ``src``."""
    src = Path(src)
    if (src / CONFIG).is_file():
        _, raw = read_config(src)
        return src, raw.get("base_model_name_or_path")
    step = src
    if not (src / STATE_FILE).is_file() and (src / LATEST).is_file():
        step = src / (src / LATEST).read_text().strip()
    if not (step / STATE_FILE).is_file():
        raise LoraError(f"{src}: neither an HF PEFT folder ({CONFIG}) nor a `mdtk train` "
                        "checkpoint (step_* folder or checkpoint root).")
    folder = step / CHECKPOINT_ADAPTER
    if not (folder / CONFIG).is_file():
        raise LoraError(f"{step} holds no LoRA adapters (a full fine-tuning checkpoint): convert "
                        "it with --to hf.")
    config = json.loads((step / STATE_FILE).read_text()).get("config") or {}
    return folder, (config.get("model") or {}).get("path")


def is_adapter(src: str | Path) -> bool:
    """Whether ``src`` is a PEFT folder or a trainer checkpoint (step or root) with adapters."""
    try:
        find_adapter(src)
    except LoraError:
        return False
    return True


def to_peft(src: str | Path, dst: str | Path, *, base: str | None = None,
            overwrite: bool = False) -> Path:
    """The adapters of ``src`` as an HF PEFT folder ``dst`` (the base recorded in its config)."""
    folder, recorded = find_adapter(src)
    read_config(folder)  # refuses what PEFT's loader would not reproduce
    _free(dst, overwrite)
    with building(dst) as tmp:
        tmp.mkdir(parents=True, exist_ok=True)
        shutil.copy2(folder / WEIGHTS, tmp / WEIGHTS)
        raw = json.loads((folder / CONFIG).read_text())
        raw["base_model_name_or_path"] = base or recorded
        (tmp / CONFIG).write_text(json.dumps(raw, indent=2))
    return Path(dst)


def merge(src: str | Path, dst: str | Path, *, base: str | None = None,
          overwrite: bool = False) -> Path:
    """The base model with the adapters of ``src`` merged, as an HF folder ``dst``."""
    from toolkit.lora.merge import merge_folder

    folder, recorded = find_adapter(src)
    base = base or recorded
    if not base:
        raise LoraError(f"{src}: --merge-lora needs the base model and none is recorded: give "
                        "--base PATH (the HF folder the adapters were trained on).")
    if not has_config(base):
        raise LoraError(f"base model {base}: no config.json there (give --base PATH, an HF "
                        "folder).")
    _free(dst, overwrite)
    return merge_folder(base, folder, dst, overwrite=overwrite)


def describe(src: str | Path) -> dict[str, Any]:
    """What ``mdtk inspect`` shows of an adapter: method, r, alpha, targets, parameters."""
    from safetensors import safe_open

    folder, base = find_adapter(src)
    spec, _ = read_config(folder)
    modules, params, tensors = set(), 0, 0
    with safe_open(str(folder / WEIGHTS), "pt") as f:
        for name in f.keys():
            parsed = split_name(name)
            if parsed is not None:
                modules.add(parsed[0])
                shape = f.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                params += n
                tensors += 1
    return {"method": spec.method, "r": spec.r, "alpha": spec.alpha, "dropout": spec.dropout,
            "rslora": spec.rslora, "targets": sorted(spec.targets), "modules": len(modules),
            "parameters": params, "tensors": tensors, "base": base, "folder": str(folder)}


def _free(dst: str | Path, overwrite: bool) -> None:
    if Path(dst).exists() and not overwrite:
        raise LoraError(f"{dst} exists: choose another output folder or pass --overwrite.")
