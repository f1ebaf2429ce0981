"""HF PEFT adapter folders: ``adapter_config.json`` + ``adapter_model.safetensors``.

Names are PEFT's own, unfused, as inference servers load them:
``base_model.model.<HF module>.lora_A.weight`` ``[r, in]``, ``...lora_B.weight`` ``[out, r]`` and
DoRA's ``...lora_magnitude_vector`` ``[out]`` (HF's ``[out, in]`` orientation also for GPT-2's
``Conv1D``, whose config says ``fan_in_fan_out``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.lora.spec import LoraError, LoraSpec

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: Where a `mdtk train` checkpoint (``step_*``) keeps its adapters as a PEFT folder.
CHECKPOINT_ADAPTER = "adapter"
PREFIX = "base_model.model."
SUFFIX = {"lora_A": ".lora_A.weight", "lora_B": ".lora_B.weight",
          "lora_magnitude_vector": ".lora_magnitude_vector"}
#: adapter_config.json keys whose non-default values mdtk cannot reproduce
UNSUPPORTED = {"bias": "none", "modules_to_save": None, "layers_to_transform": None,
               "rank_pattern": {}, "alpha_pattern": {}, "target_parameters": None,
               "layer_replication": None, "lora_bias": False, "trainable_token_indices": None,
               "use_qalora": False, "alora_invocation_tokens": None}


def tensor_name(module: str, kind: str) -> str:
    return PREFIX + module + SUFFIX[kind]


def split_name(name: str) -> tuple[str, str] | None:
    """(HF module, kind) of a PEFT tensor name, None for a name that is no LoRA tensor."""
    for kind, suffix in SUFFIX.items():
        if name.startswith(PREFIX) and name.endswith(suffix):
            return name[len(PREFIX):-len(suffix)], kind
    return None


def config_dict(spec: LoraSpec, base: str | None, fan_in_fan_out: bool) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT writes it (PEFT's own ``LoraConfig``); a local ``base``
    is recorded absolute, so the folder finds its base from any directory (hub ids stay)."""
    from peft import LoraConfig

    if base and Path(base).exists():
        base = str(Path(base).resolve())

    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                     target_modules=sorted(spec.targets), use_dora=spec.dora,
                     use_rslora=spec.rslora, fan_in_fan_out=fan_in_fan_out,
                     task_type="CAUSAL_LM", base_model_name_or_path=base)
    out = cfg.to_dict()
    out["target_modules"] = sorted(spec.targets)
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in out.items()}


def read_config(folder: str | Path) -> tuple[LoraSpec, dict[str, Any]]:
    """The spec of an adapter folder (and its raw config); LoraError for what mdtk cannot load."""
    path = Path(folder) / CONFIG
    if not path.is_file() or not (Path(folder) / WEIGHTS).is_file():
        raise LoraError(f"{folder}: not an HF PEFT adapter folder (needs {CONFIG} and {WEIGHTS}).")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LoraError(f"{path}: not valid JSON ({e}).") from e
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path}: peft_type={raw.get('peft_type')!r}; mdtk loads LORA adapters.")
    bad = {k: raw[k] for k, default in UNSUPPORTED.items()
           if raw.get(k, default) not in (default, None, {}, [], False, "none")}
    if bad:
        raise LoraError(f"{path}: {bad} cannot be reproduced on megatron-core layers (mdtk "
                        "trains one rank and alpha for every targeted projection, no biases).")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        raise LoraError(f"{path}: target_modules={targets!r} is a regex; list the projection "
                        "names instead.")
    spec = LoraSpec(method="dora" if raw.get("use_dora") else "lora", r=int(raw["r"]),
                    alpha=float(raw.get("lora_alpha", 8)),
                    dropout=float(raw.get("lora_dropout", 0.0)), targets=frozenset(targets),
                    rslora=bool(raw.get("use_rslora")))
    return spec, raw


def check_base(raw: dict[str, Any], dims: Any, where: str) -> None:
    """When the adapter names a local base folder, its sizes must be the model's (hidden size,
    layers, vocab): LoraError naming the differences."""
    from toolkit.adapters.spec import has_config, read_hf_config

    base = raw.get("base_model_name_or_path")
    if not base or not has_config(str(base)):
        return
    cfg = read_hf_config(str(base)).to_dict()  # another model's config: its own read
    cfg = cfg.get("text_config") or cfg
    have = {"hidden_size": dims.hidden, "num_hidden_layers": dims.layers,
            "vocab_size": dims.vocab}
    bad = {k: (cfg.get(k), v) for k, v in have.items() if cfg.get(k) not in (None, v)}
    if bad:
        diff = ", ".join(f"{k} {a} (adapter's base) vs {b} (this model)"
                         for k, (a, b) in bad.items())
        raise LoraError(f"{where} was made for {base}, another base model: {diff}.")
