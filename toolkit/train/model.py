"""The model of a run: its HF config read once, its shape computed once (``RunModel``), and this
rank's megatron-core chunks built from it (``build_model``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit import parallel
from toolkit.adapters.hfconfig import read_hf_config
from toolkit.checkpoint.torchfree.dtypes import PRECISIONS
from toolkit.errors import ConfigError
from toolkit.memory.model import ModelShape, model_shape_from_hf
from toolkit.models.kernels import Kernels
from toolkit.rules import Recompute
from toolkit.train.config import TrainConfig

DTYPES = {name: d.torch for name, d in PRECISIONS.items()}
RECOMPUTE: dict[Recompute, dict[str, Any]] = {  # each choice as megatron-core's config keys
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1},
}


@dataclass(frozen=True)
class RunModel:
    """``model.path``'s (or ``model.config``'s) config.json and the shape its family describes:
    read and computed once per run, then handed to every phase that needs them (the DeepSpeed
    config, the engine's rules, the model build, the FLOP count)."""

    hf_config: dict[str, Any]
    shape: ModelShape

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunModel:
        """Read and check the model before anything is written: config.json's types (the
        family's fields) and, for ``model.path``, its weight files as the converter opens them
        (safetensors headers and sizes, tensor names and shapes against config.json)."""
        path = Path(cfg.model.path or cfg.model.config)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"model: {file} not found (model.path must be an HF folder, "
                              "model.config an HF config.json).")
        hf = read_hf_config(file)
        from toolkit.train.lora import spec_of  # peft: the memory model counts the adapters

        shape = model_shape_from_hf(hf, lora=spec_of(cfg))
        if cfg.model.path:
            from toolkit.convert.sources import open_checkpoint

            open_checkpoint(path, fmt="hf").source.close()
        return cls(hf.to_dict(), shape)

    @property
    def has_experts(self) -> bool:
        """Whether the model routes over experts, as its family describes it."""
        return self.shape.experts > 0


def build_model(cfg: TrainConfig, layout: parallel.ParallelLayout, model: RunModel):
    """Fine-tune: this rank's slices of the HF checkpoint. Pretrain: this rank's slices of
    weights drawn per tensor from (seed, name), identical at every layout (``train.init``)."""
    from toolkit.adapters import adapter_for, live
    from toolkit.train.init import initialize

    dtype = DTYPES[cfg.train.precision]
    kernels = run_kernels(cfg, layout)[0]
    overrides = dict(RECOMPUTE[cfg.train.recompute], kernels=kernels)
    if cfg.model.path:
        chunks, adapter = live.load_hf(cfg.model.path, layout, dtype=dtype, **overrides)
    else:
        adapter = adapter_for(_hf_config(model), dtype=dtype)
        adapter.validate(layout)
        chunks = live.build_model(adapter, layout, **overrides)
        initialize(chunks, adapter, cfg.train.seed)  # the same weights at every layout
    if kernels.linear_cross_entropy:
        for chunk in chunks:
            chunk.linear_ce_vocab = adapter.dims.vocab
    return chunks, adapter


def run_kernels(cfg: TrainConfig, layout: parallel.ParallelLayout) -> tuple[Kernels, str]:
    """The fused kernels of the run's model (``train.fused_kernels``) and the line saying
    which; the token-mean objectives (pretraining, SFT) can take the fused linear loss."""
    from toolkit import runtime
    from toolkit.models.kernels import select

    return select(cfg.train.fused_kernels, cuda=runtime.use_cuda(), tp=layout.tp,
                  token_mean=cfg.data.mode in ("pretrain", "sft"),
                  bf16=cfg.train.precision == "bf16")


def check_packing(cfg: TrainConfig, layout: parallel.ParallelLayout, model: RunModel) -> str:
    """Refuse, before the model is built, a model whose attention packed examples cannot be
    kept apart in (``toolkit.models.packed.check_packing``); else the log line naming the
    kernel that keeps them apart."""
    from toolkit import runtime
    from toolkit.adapters import adapter_for
    from toolkit.models import packed

    source = cfg.model.path if cfg.model.path else _hf_config(model)
    config = adapter_for(source, dtype=DTYPES[cfg.train.precision]).transformer_config(layout)
    packed.check_packing(config)
    return packed.describe(config, runtime.device())


def _hf_config(model: RunModel):
    from transformers import AutoConfig

    return AutoConfig.for_model(**model.hf_config)
