"""``inspect``: what a checkpoint folder holds, and what is wrong with it (a trainer checkpoint's
files are checked against its manifest: sizes and xxh3-128 checksums)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError, manifest
from toolkit.convert.adapters import is_adapter
from toolkit.convert.sources import detect, open_checkpoint


@dataclass
class Info:
    path: Path
    format: str | None
    architecture: str | None = None
    layout: dict[str, Any] = field(default_factory=dict)
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> number of tensors
    quantization: str | None = None  # e.g. fp8 block scales, dequantized on read
    parameters: int = 0
    tensors: int = 0
    files: list[str] = field(default_factory=list)
    iteration: int | None = None
    manifest: str | None = None  # what the manifest check found (None: no manifest)
    problems: list[str] = field(default_factory=list)
    adapter: dict[str, Any] | None = None  # LoRA / DoRA: method, r, alpha, targets, parameters


def inspect(path: str | Path, *, hf_config: str | Path | None = None,
            source_format: str | None = None) -> Info:
    """What a checkpoint folder holds, and the consistency problems found (never raises for a
    damaged checkpoint: the problems are listed)."""
    path = Path(path)
    if source_format in (None, "hf-peft") and is_adapter(path):
        return _adapter_info(path)
    try:
        fmt = source_format or detect(path)
    except CheckpointError as err:
        fmt = None
        problems = [str(err)]
    info = Info(path, fmt)
    _check_manifest(path, info)
    if fmt is None:
        info.problems[:0] = problems
        return info
    try:
        op = open_checkpoint(path, hf_config, fmt)
    except (CheckpointError, ValueError, OSError) as err:
        info.problems.append(f"{type(err).__name__}: {err}")
        info.files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
        return info
    try:
        info.architecture = op.adapter.architecture
        info.iteration = op.info.get("iteration")
        info.layout = {k: v for k, v in (op.info.get("layout") or {}).items() if v}
        info.files = [str(f) for f in op.info.get("files", [])]
        info.quantization = op.info.get("quantization")
        stored = getattr(op.source, "stored_dtype", op.source.dtype)  # fp8: as on disk
        for name, shape in op.adapter.expected_tensors().items():
            dt = str(stored(op.names[name])).replace("torch.", "")
            info.dtypes[dt] = info.dtypes.get(dt, 0) + 1
            info.parameters += math.prod(shape)
            info.tensors += 1
    finally:
        op.source.close()
    return info


def manifest_folder(path: Path) -> Path | None:
    """The folder whose manifest covers ``path``: itself, the checkpoint its ``latest`` names
    (a trainer's checkpoint root), or its parent (a trainer checkpoint's ``engine/``)."""
    candidates = [path, path.parent]
    latest = path / "latest"
    if latest.is_file():
        candidates.insert(1, path / latest.read_text().strip())
    return next((p for p in candidates if (p / manifest.MANIFEST).is_file()), None)


def _check_manifest(path: Path, info: Info) -> None:
    """Every file of the manifest present, of its size and checksum (all of them, on threads)."""
    folder = manifest_folder(path)
    if folder is None:
        return
    try:
        records = manifest.read(folder) or []
    except ValueError as err:
        info.manifest = f"{folder / manifest.MANIFEST}: unreadable"
        info.problems.append(str(err))
        return
    damaged = manifest.verify(folder, records)
    info.manifest = (f"{folder / manifest.MANIFEST}: {len(records)} files, "
                     + (f"{len(damaged)} damaged" if damaged else
                        f"sizes and {manifest.ALGORITHM} checksums intact"))
    info.problems.extend(f"damaged: {folder.name}/{p}" for p in damaged)


def _adapter_info(path: Path) -> Info:
    from toolkit.convert.adapters import describe

    info = Info(path, "hf-peft")
    try:
        info.adapter = describe(path)
    except (ValueError, OSError) as err:
        info.problems.append(f"{type(err).__name__}: {err}")
        return info
    info.parameters, info.tensors = info.adapter["parameters"], info.adapter["tensors"]
    info.files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    return info
