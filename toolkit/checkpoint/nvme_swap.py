"""ZeRO-3 optimizer state that DeepSpeed offloaded to NVMe, read from the checkpoint's copy.

With ``offload_optimizer.device = "nvme"`` the fp32 master partition of each optimizer sub group
and its Adam moments live in swap files, not in memory. ``engine.save_checkpoint`` (DeepSpeed
0.19) then saves *empty* tensors for them (``fp32_flat_groups[i]`` and the base optimizer's
``exp_avg`` / ``exp_avg_sq`` have 0 elements) and copies the rank's swap folder, gradients left
out, to ``<tag>/offloaded_tensors/rankNN/`` (NN = the global rank, two digits):

- ``<first>_<last>.tensor.swp``: the sub group's fp32 partition; ``exp_avg-<first>_<last>...``
  and ``exp_avg_sq-<first>_<last>...`` its moments. ``first`` / ``last`` are the ``ds_id`` of
  the sub group's first and last parameter (ZeRO-3 numbers parameters in module order, counting
  on from earlier engines of the same process).
- Raw native-endian fp32, the sub group's elements first, then zeros up to DeepSpeed's I/O
  alignment (AIO_ALIGNED_BYTES = 1024).

Sub groups below 1 MiB are never swapped and stay in the optimizer files as usual. The sub
groups themselves are DeepSpeed's ``_create_fp16_sub_groups``: each param group cut greedily, in
order, once the summed partitions reach ``sub_group_size``. This reader rebuilds them from
``param_shapes``, checks the in-memory ones against the saved lengths, and reads the swapped ones
through a read-only memory map. DeepSpeed's own ``zero_to_fp32`` does not read these files.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

from toolkit.checkpoint import CheckpointError
from toolkit.lazy import torch

OFFLOAD_DIR = "offloaded_tensors"
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size
_SWAP = re.compile(r"^(?:(exp_avg|exp_avg_sq)-)?(\d+)_(\d+)\.tensor\.swp$")


def offloads_optimizer(zero: dict) -> bool:
    """Whether a checkpoint's ``zero_optimization`` block swapped the optimizer to NVMe."""
    return ((zero.get("offload_optimizer") or {}).get("device")) == "nvme"


def sub_groups(groups: list[dict], dp: int, sub_group_size: int) -> list[list[str]]:
    """The parameter names of each ZeRO-3 optimizer sub group, in DeepSpeed's order."""
    out: list[list[str]] = []
    for shapes in groups:
        parts = {n: math.ceil(math.prod(s) / dp) for n, s in shapes.items()}
        if sub_group_size >= sum(parts.values()):
            out.append(list(parts))
            continue
        current, size, last = [], 0, next(reversed(parts))
        for name, part in parts.items():
            current.append(name)
            size += part
            if size >= sub_group_size or name == last:
                out.append(current)
                current, size = [], 0
    return out


def _swap_files(folder: Path) -> dict[tuple[str, int, int], Path]:
    """(state, first ds_id, last ds_id) -> file; state "fp32", "exp_avg" or "exp_avg_sq"."""
    out = {}
    for p in folder.iterdir() if folder.is_dir() else ():
        m = _SWAP.match(p.name)
        if m:
            out[(m.group(1) or "fp32", int(m.group(2)), int(m.group(3)))] = p
    return out


def _read(path: Path, numel: int) -> torch.Tensor:
    import numpy as np  # only NVMe checkpoints need it: keeps `mdtk convert` start-up lean

    have = path.stat().st_size // 4
    if have < numel:
        raise CheckpointError(f"{path}: holds {have} fp32 values, its sub group needs {numel} "
                              "(truncated copy?).")
    array = np.memmap(path, dtype=np.float32, mode="r", shape=(numel,))
    with warnings.catch_warnings():  # read-only map: the readers narrow and clone, never write
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def fill_swapped(flats: list[torch.Tensor], *, groups: list[dict], order: list[str], dp: int,
                 sub_group_size: int, folder: Path, what: str, file: Path
                 ) -> list[torch.Tensor]:
    """``flats`` (one rank's per-sub-group ``what`` vectors from ``file``) with every swapped,
    empty sub group read from ``folder`` (that rank's ``offloaded_tensors/rankNN``).

    ``order``: every parameter name in module order (how ZeRO-3 numbered them)."""
    subs = sub_groups(groups, dp, sub_group_size)
    if len(subs) != len(flats):
        raise CheckpointError(f"{file}: {len(flats)} optimizer sub groups saved, "
                              f"sub_group_size={sub_group_size} over param_shapes gives "
                              f"{len(subs)}.")
    shapes = {n: s for g in groups for n, s in g.items()}
    index = {n: i for i, n in enumerate(order)}
    sizes = [sum(math.ceil(math.prod(shapes[n]) / dp) for n in sub) for sub in subs]
    swapped = [i for i, (t, n) in enumerate(zip(flats, sizes, strict=True))
               if t.numel() == 0 and n > 0]
    for i, (t, n) in enumerate(zip(flats, sizes, strict=True)):
        if i not in swapped and t.numel() < n:
            raise CheckpointError(f"{file}: sub group {i} holds {t.numel()} values, its "
                                  f"parameters need {n}.")
    if not swapped:
        return flats
    files = {k[1:]: p for k, p in _swap_files(folder).items() if k[0] == what}
    if not files:
        raise CheckpointError(
            f"{file}: {len(swapped)} optimizer sub group(s) were swapped to NVMe, but {folder} "
            f"holds no {what} swap files. DeepSpeed's save_checkpoint copies its swap folder "
            f"there ({OFFLOAD_DIR}/rankNN); copy the rank's nvme_path folder "
            "(zero_stage_3/optimizer/rankN) there if it was removed.")
    # ds_ids continue from earlier engines of the same process: fix the offset by the first
    base = min(first for first, _ in files) - min(index[subs[i][0]] for i in swapped)
    out = list(flats)
    for i in swapped:
        ids = (index[subs[i][0]] + base, index[subs[i][-1]] + base)
        if ids not in files:
            raise CheckpointError(
                f"{folder}: no {what} swap file for sub group {i} ({subs[i][0]} ... "
                f"{subs[i][-1]}, expected ds_ids {ids[0]}_{ids[1]}); found "
                + ", ".join(f"{a}_{b}" for a, b in sorted(files)) + ".")
        out[i] = _read(files[ids], sizes[i])
    return out


def swap_folder(engine: Path, global_rank: int) -> Path:
    """Where ``save_checkpoint`` put this rank's swap files."""
    return engine / OFFLOAD_DIR / f"rank{global_rank:02d}"
