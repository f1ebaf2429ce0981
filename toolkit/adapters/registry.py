"""The family registry: HF architecture (and ``model_type``) -> family.

Families register themselves with ``@register``; ``model_adapters`` (the package of family
files) is imported on the first lookup, every module of it, so adding a family is adding a file.
The registry lives here, below the plugins: core modules never import ``model_adapters``
themselves.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from toolkit.adapters.family import Family
from toolkit.adapters.hfconfig import IDENTITY, UnsupportedModel, check_fields

PLUGINS = "model_adapters"
#: the suffix of HF's reward-model classes (LlamaForSequenceClassification): a family's own
SEQ_CLS = "ForSequenceClassification"
FAMILIES: dict[str, Family] = {}  # by architecture (config.json ``architectures[0]``)
MODEL_TYPES: dict[str, Family] = {}  # by config.json ``model_type``
_discovered = False


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make ``cls`` the family of each of its architectures and model types."""
    if not cls.architectures:
        raise ValueError(f"{cls.__name__} declares no architectures.")
    family = cls()
    for table, names in ((FAMILIES, cls.architectures), (MODEL_TYPES, cls.model_types)):
        for name in names:
            if name in table and type(table[name]) is not cls:
                raise ValueError(f"{name} is registered twice ({type(table[name]).__name__}, "
                                 f"{cls.__name__}).")
            table[name] = family
    return cls


def discover() -> None:
    """Import every module of the ``model_adapters`` package (once)."""
    global _discovered
    if _discovered:
        return
    package = importlib.import_module(PLUGINS)
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{PLUGINS}.{info.name}")
    _discovered = True


def supported() -> list[str]:
    discover()
    return sorted(FAMILIES)


def family_for(architecture: str) -> Family:
    discover()
    if architecture not in FAMILIES:
        raise UnsupportedModel(
            f"architecture {architecture!r} is not supported. Supported: "
            f"{', '.join(supported())}. See docs/adding-a-model.md to add one."
        )
    return FAMILIES[architecture]


def family_of(hf: Any) -> Family:
    """The family of an HF config: by ``architectures[0]``, else by ``model_type``."""
    check_fields(hf, IDENTITY, "mdtk")
    archs = getattr(hf, "architectures", None) or []
    if archs and archs[0].endswith(SEQ_CLS):  # a reward model: the family of its causal LM
        causal = archs[0].removesuffix(SEQ_CLS) + "ForCausalLM"
        discover()
        if causal in FAMILIES:
            return FAMILIES[causal]
    if archs:
        return family_for(archs[0])
    discover()
    model_type = getattr(hf, "model_type", None)
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise UnsupportedModel(
        f"config names no architecture and model_type={model_type!r} is not one of "
        f"{', '.join(sorted(MODEL_TYPES))}: cannot pick a model family."
    )
