"""The model of a run: its ``ModelSpec`` made once (config.json read once, the mapping built once
in the run's dtype) and its shape with the run's adapters (``RunModel``), and this rank's
megatron-core chunks built from it (``build_model``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit import parallel
from toolkit.adapters.spec import ModelSpec, config_file
from toolkit.checkpoint.torchfree.dtypes import PRECISIONS
from toolkit.errors import ConfigError
from toolkit.memory.model import ModelShape, shape_of
from toolkit.models.kernels import Kernels
from toolkit.rules import Recompute
from toolkit.train.config import TrainConfig
from toolkit.train.objectives.spec import HEADS

if TYPE_CHECKING:
    import torch

DTYPES = {name: d.torch for name, d in PRECISIONS.items()}
RECOMPUTE: dict[Recompute, dict[str, Any]] = {  # each choice as megatron-core's config keys
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1},
}


@dataclass(frozen=True)
class RunModel:
    """``model.path``'s (or ``model.config``'s) model description and the shape the run trains
    (with its LoRA / DoRA adapters): made once per run, then handed to every phase that needs
    them (the DeepSpeed config, the engine's rules, the model build, the FLOP count, the
    checkpoints' ``hf_config/``)."""

    spec: ModelSpec  # live: the megatron-core model is built from it
    shape: ModelShape
    dtype: torch.dtype  # the parameters' (``train.precision``): the run's one mapping
    head: str = "lm"  # ``score``: a reward model's scalar head (``data.mode: reward``)

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunModel:
        """Read and check the model before anything is written: config.json's types (the
        family's fields) and, for ``model.path``, its weight files as the converter opens them
        (safetensors headers and sizes, tensor names and shapes against config.json)."""
        path = Path(cfg.model.path or cfg.model.config)
        file = config_file(path)
        if not file.is_file():
            raise ConfigError(f"model: {file} not found (model.path must be an HF folder, "
                              "model.config an HF config.json).")
        spec = ModelSpec.of(path if cfg.model.path else file, live=True)
        from toolkit.train.variants.lora import (
            spec_of,  # peft: the memory model counts the adapters
        )

        shape = shape_of(spec, lora=spec_of(cfg))
        dtype = DTYPES[cfg.train.precision]
        if cfg.model.path:
            from toolkit.convert.sources import open_checkpoint

            open_checkpoint(path, fmt="hf", spec=spec, dtype=dtype).source.close()
        return cls(spec, shape, dtype, HEADS.get(cfg.data.mode, "lm"))

    @property
    def adapter(self) -> Any:
        """The run's mapping (built on first use, then the same object)."""
        return self.spec.adapter(self.dtype, head=self.head)

    @property
    def has_experts(self) -> bool:
        """Whether the model routes over experts, as its family describes it."""
        return self.shape.experts > 0


def build_model(cfg: TrainConfig, layout: parallel.ParallelLayout, model: RunModel):
    """Fine-tune: this rank's slices of the HF checkpoint. Pretrain: this rank's slices of
    weights drawn per tensor from (seed, name), identical at every layout (``train.init``)."""
    from toolkit.adapters import live
    from toolkit.train.init import initialize

    kernels = run_kernels(cfg, layout)[0]
    overrides = dict(RECOMPUTE[cfg.train.recompute], kernels=kernels)
    if cfg.model.path:
        chunks, adapter = live.load_hf(model.spec, layout, dtype=model.dtype, head=model.head,
                                       **overrides)
        if adapter.seeds_score:  # a reward model from a causal LM: a new score head
            from toolkit.models.score_head import seed_score

            seed_score(chunks, cfg.train.seed,
                       float(model.spec.config.get("initializer_range", 0.02)))
    else:
        adapter = model.adapter
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
    from toolkit.models import packed

    config = model.adapter.transformer_config(layout)
    packed.check_packing(config)
    return packed.describe(config, runtime.device())
