"""Write tests/data/gpt_oss_mxfp4_transformers: a tiny GPT-OSS quantized to MXFP4 by transformers'
own quantizer, and the weights its quantized model holds, dequantized by OpenAI's code.

transformers quantizes GPT-OSS experts on the fly (``from_pretrained(..., Mxfp4Config())``) with
OpenAI's ``triton_kernels`` (hub repo ``kernels-community/gpt-oss-triton-kernels``), and
``save_pretrained`` then writes ``*_blocks`` / ``*_scales``. No hub here, and the ``kernels``
version transformers asks for is not on the package index, so this script takes a checkout of
that kernel's source (``--kernels``: the ``torch-ext`` folder of github.com/huggingface/
kernels-community's ``gpt-oss-triton-kernels``) and needs ``triton`` (``.venv-vllm`` has it). It
changes three lookups, never the quantization or the save:

- ``get_kernel`` returns the checked-out module (instead of downloading the same code);
- ``is_kernels_available`` says yes (the package only loads that module);
- ``set_use_kernels`` does nothing (``kernelize`` swaps other layers' forwards for hub kernels;
  no weights). ``use_kernels=True`` is what keeps MXFP4 on CPU (without it transformers
  dequantizes on load).

Written (bf16, as GPT-OSS ships):
- ``quantized/``: ``save_pretrained`` of the quantized model (config with quantization_config).
- ``dequantized_experts.safetensors``: each layer's ``gate_up_proj`` / ``down_proj`` ``[E, in,
  out]`` as the in-memory quantized model holds them, unpacked with OpenAI's
  ``upcast_from_mxfp_torch`` (the kernel's reference dequantizer). With ``quantized/``'s other
  tensors it is the model transformers' quantizer made: the reference mdtk must reproduce.

It prints how far the quantized experts are from the original weights and what transformers
itself says when it loads ``quantized/`` back.

    .venv-vllm/bin/python scripts/make_mxfp4_fixture.py --kernels KERNELS/torch-ext
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpt_oss_mxfp4_transformers"
#: The tiny GPT-OSS of the adapter tests (tests/dist_checks/adapter_checks.py), 2 layers (one
#: sliding, one full) and a 128-token vocabulary to keep the files small. hidden = intermediate:
#: down_proj is square, so only gate_up_proj's shape tells the blocks' orientation.
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.5,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 64})


def tiny_model():
    """The tiny GPT-OSS the MXFP4 fixtures start from: bf16, seeded random weights."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**CONFIG)).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    return model


def _patch(hub) -> None:
    import transformers.integrations.hub_kernels as hub_kernels
    import transformers.modeling_utils as modeling_utils
    import transformers.quantizers.quantizer_mxfp4 as quantizer

    hub_kernels.get_kernel = lambda *a, **k: hub
    quantizer.is_kernels_available = lambda *a, **k: True
    modeling_utils.PreTrainedModel.set_use_kernels = lambda self, *a, **k: None


def _unpacked(module, proj: str, hub) -> torch.Tensor:
    """``[E, in, out]``: the quantized model's ``proj`` as OpenAI's dequantizer reads it."""
    w = getattr(module, proj)
    scale = getattr(module, f"{proj}_precision_config").weight_scale
    data = w.storage.layout.unswizzle_data(w.storage.data)
    scales = scale.storage.layout.unswizzle_data(scale.storage.data)
    upcast = hub.numerics_details.mxfp.upcast_from_mxfp_torch
    return upcast(data, scales, torch.bfloat16, axis=1).transpose(-1, -2).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=Path, required=True,
                        help="the gpt-oss-triton-kernels checkout's torch-ext folder")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    sys.path.insert(0, str(args.kernels))
    import gpt_oss_triton_kernels as hub
    from safetensors.torch import load_file, save_file
    from transformers import GptOssForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    _patch(hub)
    with tempfile.TemporaryDirectory() as tmp:
        plain, out = Path(tmp) / "plain", Path(tmp) / "out"
        tiny_model().save_pretrained(plain)
        quantized = GptOssForCausalLM.from_pretrained(
            plain, quantization_config=Mxfp4Config(), dtype=torch.bfloat16, use_kernels=True)
        original = load_file(str(plain / "model.safetensors"))
        experts = {}
        for name, module in quantized.named_modules():
            if isinstance(module, Mxfp4GptOssExperts):
                for proj in ("gate_up_proj", "down_proj"):
                    key = f"{name}.{proj}"
                    experts[key] = _unpacked(module, proj, hub)
                    ref = original[key].float()
                    err = (experts[key].float() - ref).norm() / ref.norm()
                    print(f"{key}: {tuple(experts[key].shape)}, relative error of the "
                          f"quantization {err:.4f}")
        (out / "quantized").mkdir(parents=True)
        quantized.save_pretrained(out / "quantized")
        save_file(experts, str(out / "dequantized_experts.safetensors"),
                  metadata={"format": "pt"})
        for name, t in load_file(str(out / "quantized" / "model.safetensors")).items():
            if name.endswith(("_blocks", "_scales")):
                print(f"saved {name}: {t.dtype} {tuple(t.shape)}")
        try:
            GptOssForCausalLM.from_pretrained(out / "quantized", dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
            print("transformers loads quantized/ back")
        except Exception as e:  # noqa: BLE001 - printed: what transformers says of its own file
            print(f"transformers cannot load quantized/ back: {type(e).__name__}: "
                  f"{str(e).splitlines()[0]}")
        (out / "quantized" / "generation_config.json").unlink(missing_ok=True)
        replace_outputs(out, args.out, "quantized", "dequantized_experts.safetensors")
    print(f"wrote {args.out}")


def replace_outputs(made: Path, dest: Path, *names: str) -> None:
    """Move the files and folders ``names`` from ``made`` into ``dest``, replacing old ones."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        old = dest / name
        if old.is_dir():
            shutil.rmtree(old)
        old.unlink(missing_ok=True)
        shutil.move(str(made / name), old)


if __name__ == "__main__":
    main()
