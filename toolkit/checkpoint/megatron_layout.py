"""Megatron-LM's checkpoint folder layout, shared by its two formats (torch_dist and legacy).

A run folder (Megatron-LM's ``--save`` / ``--load``) holds ``latest_checkpointed_iteration.txt``
(an iteration number or ``release``) next to ``iter_XXXXXXX/`` (7 digits) or ``release/``.
Inside, ``mcore_dist`` keeps its DCP files; ``megatron_legacy`` one folder per model-parallel
rank, ``mp_rank_TT[_PPP][_EEE]`` (``_PPP`` when pp > 1, ``_EEE`` when ep > 1: Megatron-LM's
``get_checkpoint_name``). mdtk also stores the HF config (and tokenizer files) in
``hf_config/`` at the root, so its checkpoints convert back without extra arguments.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError
from toolkit.checkpoint.hf import CONFIG, GENERATION_CONFIG, TOKENIZER_FILES, copy_side_files

TRACKER = "latest_checkpointed_iteration.txt"
HF_CONFIG_DIR = "hf_config"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def iteration_dir_name(iteration: int | None) -> str:
    return "release" if not iteration else f"iter_{iteration:07d}"


def checkpoint_dir(path: Path, marker: Callable[[Path], bool]) -> tuple[Path, int | None]:
    """The iteration folder of a Megatron-LM checkpoint root (or the folder itself) + iteration.

    ``marker(folder)`` says whether a folder holds the format's files.
    """
    path = Path(path)
    if marker(path):
        m = re.fullmatch(r"iter_(\d+)", path.name)
        return path, int(m.group(1)) if m else None
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            sub, iteration = path / "release", None
        elif text.isdigit():
            sub, iteration = path / iteration_dir_name(int(text)), int(text)
        else:
            raise CheckpointError(f"{tracker} holds {text!r}: expected an iteration number or "
                                  "'release'.")
        if not sub.is_dir():
            raise CheckpointError(f"{tracker} points to {sub.name}, which does not exist.")
        if not marker(sub):
            raise CheckpointError(f"{sub} does not hold the checkpoint files {TRACKER} promises.")
        return sub, iteration
    raise CheckpointError(f"{path}: not a Megatron checkpoint folder (no {TRACKER}).")


def has_checkpoint(path: Path, folder_marker: Callable[[Path], bool]) -> bool:
    """Whether ``path`` is a Megatron-LM checkpoint root or iteration folder of that marker."""
    try:
        checkpoint_dir(path, folder_marker)
        return True
    except CheckpointError:
        return False


def write_tracker(root: Path, iteration: int | None) -> Path:
    """Create ``root/<iteration dir>`` and the tracker file Megatron-LM reads; returns the dir."""
    sub = root / iteration_dir_name(iteration)
    sub.mkdir(parents=True, exist_ok=True)
    (root / TRACKER).write_text("release" if not iteration else str(iteration))
    return sub


def find_hf_config(path: Path) -> Path | None:
    """The ``hf_config/`` folder mdtk stores at a checkpoint root (looked up from a sub-folder)."""
    for p in (path, *list(path.parents)[:2]):
        if (p / HF_CONFIG_DIR / CONFIG).is_file():
            return p / HF_CONFIG_DIR
    return None


def write_hf_config(root: Path, write_config: Callable[[Path], Any],
                    folders: Sequence[Path]) -> Path:
    """``root/hf_config/``, so that a checkpoint (Megatron's, or a trainer's step folder)
    describes its model: the config.json ``write_config(folder)`` writes (the model
    description's writer, ``toolkit.adapters.spec``: a layer above) and the tokenizer files and
    ``generation_config.json`` found in ``folders`` (the first folder holding each)."""
    out = root / HF_CONFIG_DIR
    out.mkdir(parents=True, exist_ok=True)
    write_config(out)
    names = (*TOKENIZER_FILES, GENERATION_CONFIG)
    for folder in folders:
        names = tuple(n for n in names if n not in copy_side_files(folder, out, names))
    return out


def rank_dir_name(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return name


def rank_of_dir(name: str, ep: int) -> tuple[int, int, int]:
    """(tp_rank, pp_rank, ep_rank) of a rank folder ``name`` (``RANK_DIR``); ``ep``: the run's
    expert-parallel size, which says whether a single suffix is the pipeline or the expert
    rank."""
    m = RANK_DIR.match(name)
    if m is None:
        raise CheckpointError(f"{name} is not a Megatron-LM rank folder (mp_rank_XX[_YYY][_ZZZ]).")
    tp_rank, second, third = int(m.group(1)), m.group(2), m.group(3)
    if third is not None:
        return tp_rank, int(second), int(third)
    if second is not None and ep > 1:
        return tp_rank, 0, int(second)
    return tp_rank, int(second or 0), 0
