"""Rank function for the trainer with ZeRO-3 NVMe offload (tests/test_trainer_nvme.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dist_checks import trainer_checks as tc
from dist_checks.trainer_checks import Case

# DeepSpeed swaps only optimizer sub groups of >= 1 MiB: at vocab 4096 (h = 64) one rank's
# fp32 partition is ~1.2 MiB, so the master weights really live in the swap files
WIDE_VOCAB = 4096


def make_wide_assets(root: Path) -> dict[str, str]:
    """A tiny tokenizer and a 2-layer Llama whose partitions are big enough to be swapped."""
    import torch
    import transformers as tf

    from toolkit.train.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(root / "tokenizer", vocab_size=tc.TOKENIZER_VOCAB)
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=WIDE_VOCAB,
                            max_position_embeddings=256, eos_token_id=0, pad_token_id=1,
                            bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(7)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "wide")
    return {"tokenizer": str(tok), "cache": str(root / "data_cache"), "wide": str(root / "wide")}


def nvme_run(assets: dict[str, str], workdir: str, nvme: str, steps: int = 2) -> dict[str, Any]:
    """``steps`` steps of the trainer at ZeRO-3 with ``offload: nvme``, a checkpoint at the last
    step and the HF export; the ZeRO block it ran and where both went."""
    from toolkit.train import trainer

    out = Path(workdir) / "zero3_nvme"
    case = Case("zero3_nvme", model="wide", zero=3, offload="nvme", steps=steps,
                overrides=(f"deepspeed.nvme_path={nvme}", f"export.hf_dir={out / 'hf'}",
                           "export.verify=false", f"checkpoint.interval={steps}"))
    result = trainer.run(tc.config(case, assets, out))
    return {"losses": result.losses, "zero": result.ds_config["zero_optimization"],
            "checkpoint": str(out / "checkpoints" / f"step_{steps:07d}"),
            "export": result.export_dir}
