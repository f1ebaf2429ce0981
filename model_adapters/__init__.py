"""Model families, registered by HF architecture name (``config.json: architectures[0]``).

Each module in this package declares one family (see docs/adding-a-model.md): a ``Family``
subclass decorated with ``@register``. Modules are discovered automatically, so adding a family
is adding one file.
"""

from __future__ import annotations

import importlib
import pkgutil

from toolkit.adapters import Family, UnsupportedModel

FAMILIES: dict[str, Family] = {}
_loaded = False


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make ``cls`` the family of each of its ``architectures``."""
    if not cls.architectures:
        raise ValueError(f"{cls.__name__} declares no architectures.")
    family = cls()
    for arch in cls.architectures:
        if arch in FAMILIES and type(FAMILIES[arch]) is not cls:
            raise ValueError(f"{arch} is registered twice ({type(FAMILIES[arch]).__name__}, "
                             f"{cls.__name__}).")
        FAMILIES[arch] = family
    return cls


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    _loaded = True


def supported() -> list[str]:
    _load_all()
    return sorted(FAMILIES)


def family_for(architecture: str) -> Family:
    _load_all()
    if architecture not in FAMILIES:
        raise UnsupportedModel(
            f"architecture {architecture!r} is not supported. Supported: "
            f"{', '.join(supported())}. See docs/adding-a-model.md to add one."
        )
    return FAMILIES[architecture]
