"""Quantize an HF checkpoint into DeepSeek-V3's published FP8 layout (tests and benchmarks).

Each 2-D linear weight becomes ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per
``block`` (amax / 448 of the block, as DeepSeek's quantizer; an all-zero block gets scale 1);
embeddings, the output layer, norms, routers and biases stay as they are (``KEEP``), as in the
published checkpoints.
The result is written atomically (``toolkit.atomic.building``).
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from toolkit.adapters.spec import read_hf_config, write_config
from toolkit.atomic import building
from toolkit.checkpoint.fp8 import FP8, SCALE
from toolkit.checkpoint.hf import CONFIG, SAFE_SINGLE, HFReader

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KEEP = re.compile(r"(embed_tokens|lm_head|wte|wpe|norm|\.gate)\.weight$|\.bias$")


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of a 2-D tensor, one scale per block."""
    (br, bc), (rows, cols) = block, w.shape
    sr, sc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.zeros(sr * br, sc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(sr, br, sc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8.torch)
    return q.view(sr * br, sc * bc)[:rows, :cols].contiguous(), scale


def quantized(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether tensor ``name`` is stored as FP8 in the published layout (a 2-D linear weight)."""
    return len(shape) == 2 and dtype.is_floating_point and not KEEP.search(name)


def quantization_config(block: tuple[int, int]) -> dict:
    """The ``quantization_config`` of a config.json in DeepSeek-V3's published FP8 layout."""
    return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
            "activation_scheme": "dynamic"}


def tensors_of(src: Path) -> dict[str, torch.Tensor]:
    with HFReader(src) as r:
        return {n: r.read(n, tuple((0, k) for k in r.shape(n))) for n in r.names}


def write_folder(dst: Path, src: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """An HF folder at ``dst``: ``tensors`` in one safetensors file, ``config``, and the other
    side files of ``src`` (tokenizer, generation config)."""
    with building(dst) as tmp:
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith("model") and f.name != CONFIG:
                shutil.copy2(f, tmp / f.name)
        save_file(tensors, str(tmp / SAFE_SINGLE), metadata={"format": "pt"})
        write_config(tmp, config)
    return dst


def quantize_folder(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """``dst``: ``src`` with its 2-D linear weights in FP8 + block scales, config declaring it."""
    out = {}
    for name, t in tensors_of(src).items():
        if quantized(name, tuple(t.shape), t.dtype):
            out[name], out[name + SCALE] = quantize(t, block)
        else:
            out[name] = t
    config = read_hf_config(src).to_dict()
    config["quantization_config"] = quantization_config(block)
    return write_folder(dst, src, out, config)
