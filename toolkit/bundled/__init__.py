"""Files that ship inside the mdtk package: the example training configs, the demo's data, the
tiny-model config and the example lm-eval tasks, found through ``importlib.resources`` so they
work from a wheel install.

A value ``bundled:REL`` (in a training YAML, an override, or as the config argument of
``mdtk train``) names the file ``toolkit/bundled/REL``, e.g. ``bundled:examples/sft_tiny.yaml``.
In a checkout, ``examples/`` at the top is a link to ``toolkit/bundled/examples/``: one copy of
each file, reachable both ways.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

PREFIX = "bundled:"
SFT_EXAMPLE = "bundled:examples/sft_tiny.yaml"
PRETRAIN_EXAMPLE = "bundled:examples/pretrain_tiny.yaml"
TINY_LLAMA_CONFIG = "bundled:examples/tiny_llama_config.json"
DATA = "bundled:examples/data"
EVAL_TASKS = "bundled:examples/eval"  # lm-eval tasks (mdtk eval --include-path)
_SHIPPED = (".yaml", ".json", ".jsonl", ".py")  # what pyproject.toml's package-data ships


def _root() -> Path:
    root = files(__name__)
    if not isinstance(root, Path):  # a zip import: no file paths to give datasets or YAML
        raise RuntimeError(f"mdtk's bundled files are inside an archive ({root}); install mdtk "
                           "unpacked (pip install does) to use them.")
    return root


def shipped() -> list[str]:
    """Every bundled file, as the ``bundled:`` names a config may use."""
    root = _root()
    return sorted(f"{PREFIX}{p.relative_to(root).as_posix()}"
                  for p in (root / "examples").rglob("*")
                  if p.suffix in _SHIPPED and "__pycache__" not in p.parts)


def training_examples() -> list[str]:
    """The example training configs (``bundled:examples/*.yaml``)."""
    return [n for n in shipped() if n.endswith(".yaml") and n.count("/") == 1]


def path(name: str) -> Path:
    """The file or folder that ``bundled:REL`` (or plain ``REL``) names; FileNotFoundError,
    listing what ships, when there is none."""
    rel = name.removeprefix(PREFIX)
    target = _root().joinpath(*rel.split("/"))
    if not rel or ".." in rel.split("/") or not target.exists():
        raise FileNotFoundError(f"{PREFIX}{rel}: mdtk ships no such file; bundled files: "
                                f"{', '.join(shipped())}.")
    return target


def resolve(value: str) -> str:
    """``bundled:REL`` -> the absolute path of that bundled file; any other value unchanged."""
    return str(path(value)) if value.startswith(PREFIX) else value
