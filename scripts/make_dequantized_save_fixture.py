"""Write tests/data/gpt_oss_dequantized_save: what transformers 5.23 writes when it saves a GPT-OSS
loaded from an MXFP4 checkpoint with ``Mxfp4Config(dequantize=True)`` (the usual start of bf16
fine-tuning), and the logits of the model it saved.

transformers 5.23 writes the dense experts under the ``*_blocks`` names (no scales, no
quantization_config), and loads that folder back with its experts initialised at random;
5.24 writes them under their own names. Folders saved by 5.23 stay in users' hands, so mdtk
reads them (``toolkit/checkpoint/mxfp4.py``, ``DenseBlocksReader``): recorded here with the
version that writes them, that reading stays tested whatever transformers is installed.

Written (the tiny GPT-OSS of scripts/make_mxfp4_fixture.py, its experts random MXFP4 blocks in
GPT-OSS's published layout, as tests/dist_checks/adapter_checks.write_mxfp4 writes them):
- ``saved/``: ``save_pretrained`` of that checkpoint loaded with ``Mxfp4Config(dequantize=True)``
  in bf16 (as GPT-OSS ships).
- ``reference.safetensors``: ``input_ids`` and the fp32 logits of the model that was saved.

    .venv/bin/python scripts/make_dequantized_save_fixture.py   # transformers==5.23.0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "gpt_oss_dequantized_save"
WRITER = "5.23.0"  # the transformers version whose save this records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]
    import transformers
    from dist_checks.adapter_checks import tokens, write_mxfp4
    from make_mxfp4_fixture import CONFIG, replace_outputs, tiny_model
    from safetensors.torch import load_file, save_file
    from transformers import GptOssForCausalLM, Mxfp4Config

    if transformers.__version__ != WRITER:
        sys.exit(f"transformers {transformers.__version__} is installed; this records "
                 f"{WRITER}'s save (the lock's version: .venv)")
    with tempfile.TemporaryDirectory() as tmp:
        plain, out = Path(tmp) / "plain", Path(tmp) / "out"
        tiny_model().save_pretrained(plain)
        dequantized = GptOssForCausalLM.from_pretrained(
            write_mxfp4(plain, Path(tmp) / "mxfp4"), dtype=torch.bfloat16,
            attn_implementation="eager", quantization_config=Mxfp4Config(dequantize=True))
        dequantized.save_pretrained(out / "saved")
        (out / "saved" / "generation_config.json").unlink(missing_ok=True)
        ids = tokens(CONFIG["vocab_size"])
        with torch.no_grad():
            logits = dequantized.float()(ids).logits
        save_file({"input_ids": ids, "logits": logits.contiguous()},
                  str(out / "reference.safetensors"), metadata={"format": "pt"})
        for name, t in load_file(str(out / "saved" / "model.safetensors")).items():
            if "layers.0.mlp.experts" in name:
                print(f"saved {name}: {t.dtype} {tuple(t.shape)}")
        replace_outputs(out, args.out, "saved", "reference.safetensors")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
