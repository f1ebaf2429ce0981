"""How each ZeRO stage lays out a model-parallel rank's parameters in DeepSpeed's files.

Each reader returns ``name -> tensor`` of one state (``what``: the fp32 master weights or an
Adam moment, ``deepspeed.STATES``), read from the memory-mapped partitions when asked:
ZeRO 0 from the module and the torch optimizer's state (``zero0_reader``), ZeRO 1/2 from the
groups' flat partitions (``Zero12``: dense groups over dp, expert groups over edp), ZeRO 3 from
each parameter's slices (``zero3_reader``); persistent buffers from the module state dict
(``module_buffers``). The format facts are in docs/converter.md, "DeepSpeed checkpoints".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError
from toolkit.lazy import torch


def _flat(osd: dict, key: str, file: Path, what: str = "fp32") -> list[torch.Tensor]:
    """Each group's flat partition of ``what``: the fp32 partitions under ``key``, or the
    moment of the same length from the base optimizer's per-group state."""
    groups = osd.get(key)
    if not isinstance(groups, list) or not all(isinstance(t, torch.Tensor) for t in groups):
        raise CheckpointError(f"{file}: no {key} (fp32 partitions) in the optimizer state.")
    if what == "fp32":
        return groups
    base = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    states = base.get("state") if isinstance(base, dict) else base  # torch's, or a lean list
    out = []
    for g, fp32 in enumerate(groups):
        moment = states[g].get(what) if states is not None and len(states) > g else None
        if not isinstance(moment, torch.Tensor):
            raise CheckpointError(f"{file}: group {g} has no optimizer state {what!r} (saved "
                                  "before the first step, or not an Adam optimizer).")
        if moment.numel() < fp32.numel():  # lean states drop the alignment padding
            moment = torch.cat([moment.flatten(), moment.new_zeros(fp32.numel() - moment.numel())])
        out.append(moment.flatten())
    return out


def module_buffers(model: dict, file: Path, what: str) -> dict[str, torch.Tensor]:
    """The persistent buffers of the module state dict (``buffer_names``); as a moment
    (``what`` != fp32), zeros: no optimizer steps a buffer."""
    module = model.get("module") or {}
    out = {}
    for name in model.get("buffer_names") or []:
        t = module.get(name)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{file}: buffer {name} is listed in 'buffer_names' but its "
                                  "'module' holds no tensor of that name.")
        out[name] = t if what == "fp32" else torch.zeros_like(t)
    return out


def zero0_reader(model: dict, groups: list[dict], what: str, file: Path
                  ) -> Callable[[str], torch.Tensor]:
    """ZeRO 0: the module holds the (fp32) weights; the torch optimizer's state the moments, by
    the parameter's index in ``param_shapes`` order."""
    module = model.get("module") or {}
    if what == "fp32":
        return lambda n: module[n]
    index = {n: i for i, n in enumerate(n for g in groups for n in g)}
    states = ((model.get("optimizer") or {}).get("state")) or {}

    def read(name: str) -> torch.Tensor:
        moment = (states.get(index[name]) or {}).get(what)
        if not isinstance(moment, torch.Tensor):
            raise CheckpointError(f"{file}: {name} has no optimizer state {what!r}.")
        return moment
    return read


@dataclass
class Zero12:
    """ZeRO 1/2 partitions of one model-parallel rank: a group's flat fp32 vector is the
    concatenation of its partitions (dp of them for dense groups, edp for expert groups)."""

    groups: list[dict]
    osds: list[dict]
    files: list[Path]
    dp: int
    what: str = "fp32"
    flats: list[list[torch.Tensor]] = field(init=False)
    moe: list[bool] = field(init=False)
    where: dict[str, tuple[int, int, int]] = field(init=False)  # name -> (group, offset, numel)
    ends: list[int] = field(init=False)  # each group's length, with alignment paddings
    counts: Any = field(init=False)  # partition_count (ways each group is split), if saved

    def __post_init__(self) -> None:
        groups, files = self.groups, self.files
        self.flats = [_flat(o, "single_partition_of_fp32_groups", f, self.what)
                      for o, f in zip(self.osds, files, strict=True)]
        if any(len(f) != len(groups) for f in self.flats):
            raise CheckpointError(f"{files[0].parent}: partitions hold "
                                  f"{[len(f) for f in self.flats]} groups, param_shapes "
                                  f"{len(groups)}.")
        pgs = (self.osds[0].get("base_optimizer_state") or {}).get("param_groups") or []
        self.moe = [bool(pgs[g].get("moe")) if g < len(pgs) and isinstance(pgs[g], dict)
                    else False for g in range(len(groups))]
        self.counts = self.osds[0].get("partition_count")
        paddings = self.osds[0].get("param_alignment_paddings")
        self.where = {}
        self.ends = []
        for g, shapes in enumerate(groups):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = math.prod(shape)
                self.where[name] = (g, offset, n)
                offset += n + (paddings[g][i] if paddings else 0)
            self.ends.append(offset)
            if not self.moe[g]:
                self._check(g, self.files, [f[g] for f in self.flats], self.dp)

    def _check(self, g: int, files: list[Path], parts: list[torch.Tensor], count: int) -> None:
        sizes = {p.numel() for p in parts}
        if len(sizes) != 1:
            raise CheckpointError(f"{files[0].parent}: group {g} partitions differ in size "
                                  f"({sorted(sizes)}): a partition file is damaged.")
        if isinstance(self.counts, list) and g < len(self.counts) and self.counts[g] != count:
            raise CheckpointError(f"{files[0]}: group {g} is partitioned {self.counts[g]} ways, "
                                  f"expected {count}.")
        avail = sizes.pop() * count
        if self.ends[g] > avail:
            raise CheckpointError(f"{files[0].parent}: group {g} needs {self.ends[g]} fp32 "
                                  f"values, the {count} partitions hold {avail}.")

    @property
    def expert_names(self) -> set[str]:
        return {n for g, shapes in enumerate(self.groups) if self.moe[g] for n in shapes}

    def _reader(self, parts: list[list[torch.Tensor]], moe: bool
                ) -> Callable[[str], torch.Tensor]:
        def read(name: str) -> torch.Tensor:
            g, offset, n = self.where[name]
            if self.moe[g] != moe:
                raise CheckpointError(f"{self.files[0].parent}: {name} is "
                                      + ("an expert" if self.moe[g] else "a dense")
                                      + " parameter, read as " + ("expert." if moe else "dense."))
            size = parts[0][g].numel()
            pieces, pos, end = [], offset, offset + n
            while pos < end:
                d, local = divmod(pos, size)
                take = min(size - local, end - pos)
                pieces.append(parts[d][g].narrow(0, local, take))
                pos += take
            flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            return flat.clone().view(tuple(self.groups[g][name]))

        return read

    def dense_reader(self) -> Callable[[str], torch.Tensor]:
        return self._reader(self.flats, False)

    def expert_reader(self, files: list[Path], parts: list[list[torch.Tensor]], edp: int
                      ) -> Callable[[str], torch.Tensor]:
        """Expert groups from ``parts`` (per edp rank, each file's groups; the same group
        layout as this rank's ``param_shapes``)."""
        for g in range(len(self.groups)):
            if self.moe[g]:
                if any(len(p) != len(self.groups) for p in parts):
                    raise CheckpointError(f"{files[0].parent}: partitions hold "
                                          f"{[len(p) for p in parts]} groups, param_shapes "
                                          f"{len(self.groups)}.")
                self._check(g, files, [p[g] for p in parts], edp)
        return self._reader(parts, True)


def zero3_reader(groups: list[dict], osds: list[dict], files: list[Path], what: str = "fp32",
                  fill: Callable[[int, list[torch.Tensor]], list[torch.Tensor]] | None = None
                  ) -> Callable[[str], torch.Tensor]:
    """ZeRO 3: parameter k sits at the same offset in every rank's flat vector; rank d holds
    elements [d * part, (d + 1) * part) of it (the last rank padded). ``fill(d, flats)``: rank
    d's sub groups completed from elsewhere (NVMe swap files)."""
    flats = [_flat(o, "fp32_flat_groups", f, what) for o, f in zip(osds, files, strict=True)]
    if fill is not None:
        flats = [fill(d, flat) for d, flat in enumerate(flats)]
    dp = len(flats)
    shapes = {n: s for g in groups for n, s in g.items()}
    where: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, shape in shapes.items():
        part = math.ceil(math.prod(shape) / dp)
        where[name] = (offset, part)
        offset += part
    for f, flat in zip(files, flats, strict=True):
        have = sum(t.numel() for t in flat)
        if have < offset:
            raise CheckpointError(f"{f}: holds {have} fp32 values, the parameters need {offset} "
                                  "(damaged or from another model).")

    def span(flat: list[torch.Tensor], start: int, n: int) -> list[torch.Tensor]:
        out = []
        for t in flat:
            if n == 0:
                break
            if start >= t.numel():
                start -= t.numel()
                continue
            take = min(t.numel() - start, n)
            out.append(t.narrow(0, start, take))
            start, n = 0, n - take
        return out

    def read(name: str) -> torch.Tensor:
        offset, part = where[name]
        pieces = [p for flat in flats for p in span(flat, offset, part)]
        full = torch.cat(pieces)
        return full[: math.prod(shapes[name])].clone().view(tuple(shapes[name]))

    return read
