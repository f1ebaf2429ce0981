"""The memory model's view of a model: the shape of its ``ModelSpec`` (``toolkit.adapters``), with
LoRA / DoRA adapters when a run trains them.

The shape itself (``ModelShape``: every parameter tensor and how megatron-core splits it) is part
of the model description, ``toolkit.adapters.shape``; it is re-exported here for the memory
model, the planner and the generator, which read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from toolkit.adapters.hfconfig import HFConfigError, UnsupportedModel
from toolkit.adapters.shape import COL, EXPERT, REP, ROW, VOCAB, ModelShape, TensorSpec
from toolkit.adapters.spec import ModelSpec
from toolkit.errors import UserError
from toolkit.lora.spec import LoraError, LoraSpec
from toolkit.lora.targets import model_projections

__all__ = ["COL", "EXPERT", "REP", "ROW", "VOCAB", "ModelConfigError", "ModelShape", "TensorSpec",
           "load_model_shape", "model_shape_from_hf", "shape_of"]


class ModelConfigError(UserError):
    """An HF config the memory model cannot read; the message names the key."""


def shape_of(spec: ModelSpec, lora: LoraSpec | None = None) -> ModelShape:
    """The shape of ``spec`` (``lora``: with those adapters, targets resolved by
    ``toolkit.lora.targets``, base frozen)."""
    try:
        shape = spec.shape
    except UnsupportedModel as e:
        raise ModelConfigError(str(e)) from e
    if lora is None:
        return shape
    try:
        adapters, adapted = model_projections(spec.decoder, lora)
    except LoraError as e:
        raise ModelConfigError(str(e)) from e
    return shape.with_lora(((p.layer, *p.numel(adapters.r, adapters.dora)) for p in adapted),
                           adapters.r)


def model_shape_from_hf(cfg: Mapping[str, Any] | Any, name: str = "model",
                        lora: LoraSpec | None = None) -> ModelShape:
    """The shape of an HF config (a config.json dict, ``HFConfig``, transformers config or
    ``ModelSpec``), as its model family describes it: no per-architecture code here."""
    return shape_of(ModelSpec.of(cfg, name=name), lora)


def load_model_shape(spec: str, lora: LoraSpec | None = None) -> ModelShape:
    """A preset name, a ``config.json`` path, a folder holding one, or a hub id (``lora``: with
    those adapters, see ``shape_of``)."""
    try:
        model = ModelSpec.named(spec)
    except HFConfigError as e:
        raise ModelConfigError(str(e)) from e
    return shape_of(model, lora)
