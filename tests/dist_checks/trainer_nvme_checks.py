"""Rank function for the trainer with ZeRO-3 NVMe offload (tests/test_trainer_nvme.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from dist_checks import trainer_checks as tc
from dist_checks.trainer_checks import Case

# DeepSpeed swaps only tensors of >= 1 MiB: at vocab 8192 (h = 64) one rank's optimizer
# partition is ~2.2 MiB and its embedding / output partitions 1 MiB each, so both the master
# weights and those parameters really live in swap files
WIDE_VOCAB = 8192


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


def nvme_run(assets: dict[str, str], workdir: str, nvme: str, steps: int = 2
             ) -> dict[str, dict[str, Any]]:
    """``steps`` steps of the trainer at ZeRO-3 with ``offload: nvme`` (the generator's config:
    optimizer on NVMe), then the same with that config plus parameters on NVMe (a user
    ``deepspeed.config``); each with a checkpoint at the last step and the HF export."""
    import torch.distributed as dist

    from toolkit.train import trainer

    runs: dict[str, dict[str, Any]] = {}
    user = Path(workdir) / "params_on_nvme.json"
    for name in ("optimizer", "params"):
        out = Path(workdir) / name
        extra: tuple[str, ...] = ()
        if name == "params":
            extra = (f"deepspeed.config={user}",)
        case = Case(name, model="wide", zero=3, offload="nvme", steps=steps,
                    overrides=(f"deepspeed.nvme_path={nvme}/{name}", f"export.hf_dir={out / 'hf'}",
                               "export.verify=false", f"checkpoint.interval={steps}", *extra))
        result = trainer.run(tc.config(case, assets, out))
        runs[name] = {"losses": result.losses, "zero": result.ds_config["zero_optimization"],
                      "checkpoint": str(out / "checkpoints" / f"step_{steps:07d}"),
                      "export": result.export_dir}
        if name == "optimizer" and dist.get_rank() == 0:
            _params_on_nvme(result.ds_config, f"{nvme}/params", user)
        dist.barrier()
    return runs


def _params_on_nvme(config: dict[str, Any], nvme: str, path: Path) -> None:
    """``config`` with the parameters offloaded to NVMe too. DeepSpeed 0.19.8's NVMe parameter
    prefetch fails on the trainer's chunks ("param N already assigned swap buffer"), so
    prefetching is off."""
    config = copy.deepcopy(config)
    zero = config["zero_optimization"]
    zero["offload_optimizer"]["nvme_path"] = nvme
    zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                             "buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 0}
    zero["stage3_prefetch_bucket_size"] = 0
    path.write_text(json.dumps(config))
