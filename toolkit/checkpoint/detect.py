"""Which checkpoint format a path holds: each format registers a ``looks_like(path)`` test.

``LOOKS_LIKE`` is filled by ``toolkit.convert.register_source`` (built-in formats: hf, mcore,
megatron-legacy; plugins such as deepspeed register themselves the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toolkit.checkpoint.hf import BIN_INDEX, BIN_SINGLE, SAFE_INDEX, SAFE_SINGLE, CheckpointError

LOOKS_LIKE: dict[str, Callable[[Path], bool]] = {}


def looks_like_hf(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        (path / f).is_file() for f in (SAFE_INDEX, SAFE_SINGLE, BIN_INDEX, BIN_SINGLE))


def detect(path: str | Path) -> str:
    """The format name of ``path``; raises CheckpointError when none or several match."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist.")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file: pass the checkpoint folder.")
    found = [name for name, test in LOOKS_LIKE.items() if test(path)]
    if not found:
        raise CheckpointError(f"{path}: not a known checkpoint format (tried "
                              f"{', '.join(LOOKS_LIKE)}). Pass the folder holding config.json "
                              "(HF), latest_checkpointed_iteration.txt (Megatron) or the "
                              "iteration folder.")
    if len(found) > 1:
        raise CheckpointError(f"{path} looks like several formats ({', '.join(found)}): pass "
                              "--from to choose.")
    return found[0]
