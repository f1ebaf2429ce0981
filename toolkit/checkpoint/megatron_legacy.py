"""Legacy Megatron-LM checkpoints: ``iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``.

One ``torch.save`` file per (tensor, pipeline, expert) rank holding ``model`` (or ``model0``,
``model1``, ... with virtual pipeline stages): the rank's GPTModel ``state_dict`` with chunk-local
layer and expert numbers, plus ``_extra_state`` entries (None for megatron-core's local linear
layers), ``checkpoint_version``, ``iteration`` and ``args`` (an ``argparse.Namespace``). The
directory suffix ``_PPP`` appears when pp > 1 and ``_EEE`` when ep > 1 (Megatron-LM's
``get_checkpoint_name``; ``megatron_layout`` names and parses these folders).

Which local tensor holds which part of which global tensor is exactly the mapping engine's
``plan_rank`` for that rank's ``Coord``: the writer fills each file from the plans, the reader
inverts them (shards -> HF tensors -> the full tp=1 megatron tensor) for ``McoreFullSource``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError, formats
from toolkit.checkpoint.canonical import McoreFullSource, hf_from_shards, local_tensor
from toolkit.checkpoint.megatron_layout import (
    RANK_DIR,
    checkpoint_dir,
    find_hf_config,
    has_checkpoint,
    rank_dir_name,
    rank_of_dir,
)
from toolkit.checkpoint.megatron_meta import CHECKPOINT_VERSION, extra_state_module
from toolkit.checkpoint.source import ModelAdapter, Opening
from toolkit.checkpoint.torchfree.dtypes import to_torch
from toolkit.checkpoint.torchfree.safe_load import load_torch
from toolkit.lazy import torch
from toolkit.mapping import Coord, Table, plan_rank

FORMAT = "megatron-legacy"
FILE = "model_optim_rng.pt"


def marker(path: Path) -> bool:
    return path.is_dir() and any(RANK_DIR.match(p.name) and (p / FILE).is_file()
                                 for p in path.iterdir())


def looks_like(path: Path) -> bool:
    return has_checkpoint(path, marker)


@dataclass
class LegacyCheckpoint:
    """The files of one iteration, opened lazily (memory-mapped) by rank coordinate."""

    path: Path
    iteration: int | None
    tp: int
    pp: int
    ep: int
    vpp: int
    files: dict[tuple[int, int, int], Path]  # (tp_rank, pp_rank, ep_rank) -> file
    args: Any
    _loaded: dict[tuple[int, int, int], dict] | None = None

    @classmethod
    def open(cls, path: Path) -> LegacyCheckpoint:
        folder, iteration = checkpoint_dir(path, marker)
        found = {}
        for p in sorted(folder.iterdir()):
            if RANK_DIR.match(p.name):
                if not (p / FILE).is_file():
                    raise CheckpointError(f"{p} has no {FILE}.")
                found[p.name] = p / FILE
        first = load_torch(next(iter(found.values())))
        args = first.get("args")
        ep_size = int(getattr(args, "expert_model_parallel_size", 1) or 1)
        files = {rank_of_dir(name, ep_size): file for name, file in found.items()}
        tp = 1 + max(k[0] for k in files)
        pp = 1 + max(k[1] for k in files)
        ep = 1 + max(k[2] for k in files)
        want = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
        if set(files) != want:
            missing = sorted(want - set(files))
            raise CheckpointError(f"{folder}: rank folders for (tp, pp, ep) ranks {missing} are "
                                  f"missing (tp={tp}, pp={pp}, ep={ep}).")
        models = sorted(k for k in first if re.fullmatch(r"model\d*", k))
        if not models:
            raise CheckpointError(f"{next(iter(found.values()))} has no 'model' entry.")
        vpp = len(models) if models != ["model"] else 1
        return cls(folder, iteration, tp, pp, ep, vpp, files, args)

    def state(self, rank: tuple[int, int, int]) -> dict:
        if self._loaded is None:
            self._loaded = {}
        if rank not in self._loaded:
            self._loaded[rank] = load_torch(self.files[rank])
        return self._loaded[rank]

    def chunk(self, rank: tuple[int, int, int], chunk: int) -> dict[str, Any]:
        st = self.state(rank)
        key = "model" if self.vpp == 1 and "model" in st else f"model{chunk}"
        if key not in st:
            raise CheckpointError(f"{self.files[rank]} has no {key!r} entry.")
        return st[key]

    def coords(self) -> list[tuple[tuple[int, int, int], Coord]]:
        return [(r, Coord(tp_rank=r[0], tp=self.tp, pp_rank=r[1], pp=self.pp, vpp=self.vpp,
                          ep_rank=r[2], ep=self.ep, etp_rank=r[0], etp=self.tp))
                for r in sorted(self.files)]


def _padded_vocab(ckpt: LegacyCheckpoint, adapter: ModelAdapter) -> int:
    rows = ckpt.chunk((0, 0, 0), 0).get("embedding.word_embeddings.weight")
    if rows is None:
        raise CheckpointError(f"{ckpt.files[(0, 0, 0)]} has no embedding.word_embeddings.weight "
                              "(first pipeline stage).")
    return rows.shape[0] * ckpt.tp


def open_source(path: Path, make_adapter: formats.AdapterFactory) -> Opening:
    """A legacy checkpoint as an HF-named source, its adapter (``make_adapter(hf_dir, common)``)
    and info (the ``formats`` opener)."""
    ckpt = LegacyCheckpoint.open(path)
    adapter = make_adapter(find_hf_config(ckpt.path),
                           {"args": ckpt.args, "iteration": ckpt.iteration,
                            "root": ckpt.path.parent})
    padded = _padded_vocab(ckpt, adapter)
    table: Table = adapter.table_at(padded)
    rules = dict(table.items())
    full_rules = dict(adapter.table_at(adapter.dims.vocab).items())
    holders: dict[str, dict[int, tuple[tuple[int, int, int], int, str]]] = {}
    for rank, coord in ckpt.coords():
        plans = plan_rank(table, coord)
        planned = {(t.chunk, t.name) for t in plans}
        for t in plans:
            holders.setdefault(t.key, {}).setdefault(t.shard, (rank, t.chunk, t.name))
        for chunk in range(ckpt.vpp):
            sd = ckpt.chunk(rank, chunk)
            unknown = [n for n, v in sd.items() if (chunk, n) not in planned
                       and not n.endswith("._extra_state") and isinstance(v, torch.Tensor)]
            if unknown:
                raise CheckpointError(f"{ckpt.files[rank]} (chunk {chunk}) holds tensors the "
                                      f"{adapter.architecture} mapping does not use: "
                                      f"{', '.join(unknown[:8])}. Refusing to drop weights.")
            missing = [t.name for t in plans if t.chunk == chunk and t.name not in sd]
            if missing:
                raise CheckpointError(f"{ckpt.files[rank]} (chunk {chunk}) lacks "
                                      f"{', '.join(missing[:8])}.")
            wrong = [f"{t.name}: {tuple(sd[t.name].shape)}, expected {tuple(t.shape)}"
                     for t in plans if t.chunk == chunk
                     and tuple(getattr(sd[t.name], "shape", ())) != tuple(t.shape)]
            if wrong:
                raise CheckpointError(f"{ckpt.files[rank]} (chunk {chunk}): tensor shapes differ "
                                      f"from the model's config at tp={ckpt.tp}: "
                                      f"{'; '.join(wrong[:8])}.")

    def get(key: str) -> torch.Tensor:
        shards = {}
        for shard, (rank, chunk, name) in holders[key].items():
            shards[shard] = ckpt.chunk(rank, chunk)[name]
        hf = hf_from_shards(rules[key], shards)
        dtype = next(iter(shards.values())).dtype
        return local_tensor(full_rules[key], 0, 1, lambda n, r: hf[n][tuple(
            slice(a, b) for a, b in r)], dtype)

    shapes = {}
    for key, shards in holders.items():
        rank, chunk, name = shards[min(shards)]
        shapes[key] = (full_rules[key].local_shape(1), ckpt.chunk(rank, chunk)[name].dtype)
    info = {"iteration": ckpt.iteration, "folder": ckpt.path,
            "layout": {"tp": ckpt.tp, "pp": ckpt.pp, "vpp": ckpt.vpp if ckpt.vpp > 1 else None,
                       "ep": ckpt.ep},
            "files": sorted(str(f.relative_to(ckpt.path)) for f in ckpt.files.values())}
    return Opening(McoreFullSource(adapter, adapter.hf_config, shapes, get), adapter, info)


# -- writer ---------------------------------------------------------------------------------------

def rank_coords(tp: int, pp: int, vpp: int, ep: int) -> list[Coord]:
    return [Coord(tp_rank=t, tp=tp, pp_rank=p, pp=pp, vpp=vpp, ep_rank=e, ep=ep, etp_rank=t,
                  etp=tp)
            for p in range(pp) for t in range(tp) for e in range(ep)]


def rank_state(table: Table, coord: Coord, read: Callable, dtype_of: Callable[[str], Any],
               tick: Callable[[int], None] = lambda n: None) -> dict[str, dict[str, Any]]:
    """``{'model' | 'model<v>': state_dict}`` of one rank, filled from ``read``."""
    rules = dict(table.items())
    chunks: dict[int, dict[str, Any]] = {v: {} for v in range(coord.vpp)}
    for t in plan_rank(table, coord):
        rule = rules[t.key]
        tensor = local_tensor(rule, t.shard, t.shards, read, dtype_of(rule.sources[0]))
        chunks[t.chunk][t.name] = tensor
        module = extra_state_module(t.name)
        if module:
            chunks[t.chunk][f"{module}._extra_state"] = None
        tick(tensor.numel() * tensor.element_size())
    last = coord.pp_rank == coord.pp - 1
    if last:  # megatron-core's output layer (a linear layer) exists even when tied
        chunks[coord.vpp - 1]["output_layer._extra_state"] = None
    if coord.vpp == 1:
        return {"model": chunks[0]}
    return {f"model{v}": sd for v, sd in chunks.items()}


def rank_bytes(table: Table, coord: Coord, dtype_of: Callable[[str], Any]) -> int:
    """Bytes of the tensors of one rank file (for progress and balancing workers)."""
    rules = dict(table.items())
    total = 0
    for t in plan_rank(table, coord):
        n = 1
        for s in t.shape:
            n *= s
        total += n * dtype_of(rules[t.key].sources[0]).itemsize
    return total


def write_rank_file(folder: Path, coord: Coord, table: Table, read: Callable,
                    dtype_of: Callable[[str], Any], extra: dict[str, Any],
                    tick: Callable[[int], None] = lambda n: None) -> Path:
    sub = folder / rank_dir_name(coord.tp_rank, coord.pp_rank, coord.ep_rank, coord.pp, coord.ep)
    sub.mkdir(parents=True, exist_ok=True)
    state = {**rank_state(table, coord, read, dtype_of, tick),
             "checkpoint_version": CHECKPOINT_VERSION, **_torch_dtypes(extra)}
    torch.save(state, sub / FILE)
    return sub / FILE


def _torch_dtypes(common: dict[str, Any]) -> dict[str, Any]:
    """``common`` with the run arguments' dtypes as torch's (``params_dtype`` is a ``DType``):
    rank files hold tensors, so ``torch.save`` writes them, and it pickles only torch's dtypes
    as the names Megatron-LM reads (torch_dist's ``common.pt`` is written by ``torch_record``,
    which pickles either)."""
    args = common.get("args")
    if args is None:
        return common
    fixed = {k: to_torch(v) for k, v in vars(args).items()}
    return {**common, "args": argparse.Namespace(**fixed)}


formats.register(FORMAT, open_source, looks_like)  # see toolkit.checkpoint.formats
