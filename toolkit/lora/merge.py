"""Merge an HF PEFT adapter into its base HF checkpoint, file to file (``--merge-lora``).

Each adapted weight is merged in float32 exactly as PEFT's ``merge_and_unload()`` computes it
(``W + transpose(B @ A) * s``; DoRA: ``m / ||W + dW|| * (W + dW)`` per output row) and written in
the checkpoint's dtype; every other tensor is copied. One tensor in memory at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from toolkit.lora.peft_io import WEIGHTS, split_name
from toolkit.lora.spec import LoraSpec


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  magnitude: torch.Tensor | None, scaling: float,
                  fan_in_fan_out: bool) -> torch.Tensor:
    """One merged weight, float32 (stored orientation: ``[in, out]`` when ``fan_in_fan_out``)."""
    def t(x: torch.Tensor) -> torch.Tensor:
        return x.T if fan_in_fan_out else x

    w = weight.float()
    delta = t(b.float() @ a.float()) * scaling
    if magnitude is None:
        return w + delta
    norm = torch.linalg.norm(t(w) + 1 * t(delta), dim=1)
    factor = t((magnitude.float() / norm).view(-1, 1))
    return factor * (w + delta)


def merge_folder(base: str | Path, adapter_dir: str | Path, out: str | Path, *,
                 overwrite: bool = False) -> Path:
    """Write ``out``: the HF checkpoint ``base`` with the adapter of ``adapter_dir`` merged."""
    from safetensors import safe_open

    from toolkit.adapters.live import generation_config
    from toolkit.adapters.spec import ConfigFile, ModelSpec
    from toolkit.checkpoint.hf import HFReader
    from toolkit.checkpoint.hf_writer import HFWriter
    from toolkit.checkpoint.torchfree.dtypes import to_torch
    from toolkit.lora.peft_io import read_config
    from toolkit.lora.targets import check_adapter

    spec, raw = read_config(adapter_dir)
    adapter = ModelSpec.of(base, live=True).adapter()  # the merge's one model description
    with HFReader(base) as reader, safe_open(str(Path(adapter_dir) / WEIGHTS), "pt") as lora:
        stored = {n: reader.shape(n) for n in reader.names}
        names = adapter.match_checkpoint(stored)  # expected HF name -> stored name
        tensors = _by_module(lora)
        check_adapter(adapter, spec, {m: {k: tuple(lora.get_slice(n).get_shape())
                                          for k, n in kinds.items()}
                                      for m, kinds in tensors.items()}, where=str(adapter_dir))
        by_stored = {names[m + ".weight"]: m for m in tensors}
        dtype = to_torch(adapter.hf_dtype)
        writer = HFWriter(out, overwrite=overwrite)
        try:
            for name in reader.names:
                w = reader.read(name, tuple((0, n) for n in reader.shape(name)))
                module = by_stored.get(name)
                if module is not None:
                    k = tensors[module]
                    w = merged_weight(w, lora.get_tensor(k["lora_A"]), lora.get_tensor(k["lora_B"]),
                                      lora.get_tensor(k["lora_magnitude_vector"])
                                      if "lora_magnitude_vector" in k else None,
                                      _scaling(spec), bool(raw.get("fan_in_fan_out"))).to(dtype)
                writer.add(name, w)
            return writer.finish(ConfigFile(adapter.export_config()),
                                 generation_config=generation_config(adapter.source,
                                                                     adapter.hf_config),
                                 copy_from=adapter.source)
        except BaseException:
            writer.abort()
            raise


def _scaling(spec: LoraSpec) -> float:
    return spec.alpha / (spec.r ** 0.5 if spec.rslora else spec.r)


def _by_module(lora: Any) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name in lora.keys():
        parsed = split_name(name)
        if parsed is not None:
            out.setdefault(parsed[0], {})[parsed[1]] = name
    return out
