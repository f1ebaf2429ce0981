"""DeepSpeed checkpoints (mdtk's trainer, or plain DeepSpeed of an HF model), read offline as a
converter source: the engine folder found, its model-parallel ranks opened, their parameters
reassembled through the adapter's mapping.

The facts of DeepSpeed's files this reader relies on (layout, ZeRO 1/2/3 partitions, experts,
context parallelism, buffers, Adam moments, NVMe swap files, what is refused) are in
docs/converter.md, "DeepSpeed checkpoints". The ZeRO partition readers are in
``deepspeed_zero``, the NVMe swap files in ``nvme_swap``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError, formats, nvme_swap
from toolkit.checkpoint.canonical import McoreFullSource, hf_from_shards, local_tensor
from toolkit.checkpoint.deepspeed_zero import Zero12, module_buffers, zero0_reader, zero3_reader
from toolkit.checkpoint.hf import CONFIG
from toolkit.checkpoint.megatron_layout import HF_CONFIG_DIR
from toolkit.checkpoint.source import Opening
from toolkit.checkpoint.torchfree.safe_load import load_torch
from toolkit.lazy import torch
from toolkit.mapping import Coord, plan_rank
from toolkit.mapping.plan import EXPERTS

FORMAT = "deepspeed"
STATE_FILE = "trainer_state.json"
ENGINE_TAG = "engine"
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's first and second moments, as DeepSpeed names them
STATES = ("fp32", *MOMENTS)  # with the master weights
_MODEL_12 = re.compile(r"^mp_rank_(\d{2})_model_states\.pt$")
_MODEL_3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d{2})_model_states\.pt$")


def _engine_dir(path: Path) -> Path | None:
    """The folder holding DeepSpeed's ``*_model_states.pt`` for a root, step or engine folder."""
    path = Path(path)
    if not path.is_dir():
        return None
    if any(_MODEL_12.match(p.name) or _MODEL_3.match(p.name) for p in path.iterdir()):
        return path
    if (path / ENGINE_TAG).is_dir():
        return _engine_dir(path / ENGINE_TAG)
    latest = path / "latest"  # mdtk's checkpoints/latest, or DeepSpeed's own tag file
    if latest.is_file():
        tag = latest.read_text().strip()
        if tag and "/" not in tag and (path / tag).is_dir():
            return _engine_dir(path / tag)
    return None


def looks_like(path: Path) -> bool:
    return _engine_dir(path) is not None


def _head(engine: Path) -> tuple[Path, dict, int]:
    """The first model-states file of an engine folder, its contents and the ZeRO stage."""
    names = sorted(p.name for p in engine.iterdir())
    stage3 = [n for n in names if _MODEL_3.match(n)]
    first = engine / (stage3[0] if stage3 else next(n for n in names if _MODEL_12.match(n)))
    head = load_torch(first)
    zero = (head.get("ds_config") or {}).get("zero_optimization") or {}
    return first, head, 3 if stage3 else int(zero.get("stage", 0) or 0)


def zero_stage(path: Path) -> int:
    """The ZeRO stage of the DeepSpeed checkpoint under ``path`` (reads one file's header)."""
    engine = _engine_dir(path)
    if engine is None:
        raise CheckpointError(f"{path}: no DeepSpeed checkpoint (no *_model_states.pt).")
    return _head(engine)[2]


def _partition_file(engine: Path, dp_rank: int, mp_rank: int) -> Path:
    name = f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
    for prefix in ("", "bf16_"):
        if (engine / (prefix + name)).is_file():
            return engine / (prefix + name)
    return engine / name  # (missing: the caller names it)


@dataclass
class _Rank:
    """One model-parallel rank: its parameters (name -> shape) and how to read each one."""

    mp_rank: int
    files: list[Path]
    shapes: dict[str, torch.Size]
    read: Callable[[str], torch.Tensor]  # dense parameters (and all of them at ep = etp = 1)
    zero12: Zero12 | None = None  # ZeRO 1/2: the partitions, for the expert reader
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # persistent, from module


@dataclass
class DeepSpeedCheckpoint:
    path: Path  # the engine folder
    step: int | None
    stage: int
    tp: int
    pp: int
    vpp: int
    dp: int
    state: dict[str, Any]  # trainer_state.json (empty when absent)
    ep: int = 1
    etp: int = 1
    cp: int = 1  # dp counts DeepSpeed's data-parallel ranks: megatron-core's dp x cp
    ranks: dict[int, _Rank] = field(default_factory=dict)
    what: str = "fp32"  # which per-parameter state the readers return (see STATES)

    @property
    def files(self) -> list[Path]:
        return [f for r in self.ranks.values() for f in r.files]

    @classmethod
    def open(cls, path: Path, state: str = "fp32") -> DeepSpeedCheckpoint:
        if state not in STATES:
            raise CheckpointError(f"state {state!r}: one of {STATES}.")
        engine = _engine_dir(path)
        if engine is None:
            raise CheckpointError(f"{path}: no DeepSpeed checkpoint (no *_model_states.pt under "
                                  "it, its engine/ folder or the step named by 'latest').")
        state_json: dict[str, Any] = {}
        state_file = engine.parent / STATE_FILE
        if state_file.is_file():
            try:
                state_json = json.loads(state_file.read_text())
            except json.JSONDecodeError as err:
                raise CheckpointError(f"{state_file} is not valid JSON ({err}).") from err
        first, head, stage = _head(engine)
        zero = (head.get("ds_config") or {}).get("zero_optimization") or {}
        dims = head.get("checkpoint_parallel_dimensions") or {}
        layout = state_json.get("layout") or {}
        tp = int(dims.get("tp_degree") or layout.get("tp") or 1)
        pp = int(dims.get("pp_degree") or layout.get("pp") or 1)
        vpp = int(layout.get("vpp") or 1)
        mp = int(head.get("mp_world_size") or tp * pp)
        dp = int(head.get("dp_world_size") or 1)
        if mp != tp * pp:
            raise CheckpointError(f"{first}: mp_world_size={mp}, but tp={tp} x pp={pp}.")
        ep = int(layout.get("ep") or 1)
        etp = int(layout.get("etp") or tp)
        cp = int(layout.get("cp") or 1)
        if dp % cp:  # DeepSpeed's dp group is megatron-core's dp x cp group
            raise CheckpointError(f"{first}: dp_world_size={dp} is not a multiple of cp={cp} "
                                  f"({STATE_FILE} and the engine files disagree).")
        if ep > 1 and stage in (0, 3):
            raise CheckpointError(
                f"{engine.parent}: saved with ep={ep} and ZeRO-{stage}; DeepSpeed "
                + ("keeps the weights of expert-parallel rank 0's experts only (the other ep "
                   "ranks' experts are in no file)" if stage == 0 else
                   "ZeRO-3 does not partition megatron-core's experts")
                + ". Only ZeRO 1/2 checkpoints with ep > 1 can be converted.")
        if (tp * dp) % (ep * etp):
            raise CheckpointError(f"{engine.parent}: ep={ep} x etp={etp} does not divide "
                                  f"tp={tp} x dp={dp}.")
        if nvme_swap.offloads_optimizer(zero) and stage == 3:
            if mp > 1:
                raise CheckpointError(
                    f"{first}: optimizer swapped to NVMe at tp={tp} x pp={pp}: the swap files "
                    "are filed by global rank, which is read only at tp = pp = 1.")
            if ((head.get("ds_config") or {}).get("checkpoint") or {}).get(
                    "use_node_local_storage"):
                raise CheckpointError(f"{first}: optimizer swapped to NVMe with "
                                      "use_node_local_storage: the swap files are filed by "
                                      "local rank, ambiguous across nodes.")
        step = state_json.get("step")
        ckpt = cls(engine, step, stage, tp, pp, vpp, dp, state_json, ep=ep, etp=etp, cp=cp,
                   what=state)
        for m in range(mp):
            ckpt.ranks[m] = ckpt._open_rank(m, head if first == ckpt._model_files(m)[0] else None)
        if ep > 1 and not any(r.zero12 and any(r.zero12.moe) for r in ckpt.ranks.values()):
            raise CheckpointError(f"{engine}: saved with ep={ep}, but no optimizer group is "
                                  "an expert (moe) group.")
        return ckpt

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.ep * self.etp)

    def expert_position(self, tp_rank: int, dp_rank: int) -> tuple[int, int, int]:
        """(expert-TP rank, ep rank, edp rank) of the rank at (tp_rank, dp_rank) of a stage."""
        b = tp_rank + self.tp * dp_rank
        return b % self.etp, (b // self.etp) % self.ep, b // (self.etp * self.ep)

    def _what(self, m: int, d: int) -> str:
        if self.ep == 1:
            return ""
        t, e, x = self.expert_position(m % self.tp, d)
        return (f" (dense partition {d} of {self.dp}; experts of ep rank {e}"
                + (f", etp rank {t}" if self.etp > 1 else "")
                + f", expert partition {x} of {self.edp})")

    def _model_files(self, m: int) -> list[Path]:
        if self.stage == 3:
            return [self.path / f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt"
                    for d in range(self.dp)]
        return [self.path / f"mp_rank_{m:02d}_model_states.pt"]

    def _open_rank(self, m: int, head: dict | None) -> _Rank:
        model_files = self._model_files(m)
        optim_files = ([] if self.stage == 0 else
                       [_partition_file(self.path, d, m) for d in range(self.dp)])
        missing = [str(f) for f in model_files if not f.is_file()]
        missing += [f"{f}{self._what(m, d)}" for d, f in enumerate(optim_files)
                    if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{self.path}: model-parallel rank {m} of tp={self.tp} x pp={self.pp} "
                f"(dp={self.dp}, ep={self.ep}, ZeRO-{self.stage}) is incomplete: missing "
                + ", ".join(missing) + ".")
        model = head if head is not None else load_torch(model_files[0])
        groups = model.get("param_shapes")
        if not isinstance(groups, list):
            raise CheckpointError(f"{model_files[0]} has no 'param_shapes'.")
        if model.get("frozen_param_shapes"):
            raise CheckpointError(f"{model_files[0]}: frozen parameters are not supported.")
        rank = self._read_rank(m, model, groups, model_files, optim_files)
        rank.buffers = module_buffers(model, model_files[0], self.what)
        return rank

    def _read_rank(self, m: int, model: dict, groups: list[dict], model_files: list[Path],
                   optim_files: list[Path]) -> _Rank:
        """mp rank ``m``'s parameters, read from its ZeRO partitions (or, ZeRO 0, its module)."""
        shapes = {n: torch.Size(s) for g in groups for n, s in g.items()}
        files = [*model_files, *optim_files]
        if self.stage == 0:
            return _Rank(m, files, shapes, zero0_reader(model, groups, self.what,
                                                         model_files[0]))
        parts = [load_torch(f) for f in optim_files]
        osds = []
        for f, p in zip(optim_files, parts, strict=True):
            osd = p.get("optimizer_state_dict") if isinstance(p, dict) else None
            if not isinstance(osd, dict):
                raise CheckpointError(f"{f} has no 'optimizer_state_dict'.")
            osds.append(osd)
        if self.stage == 3:
            fill = self._swapped_reader(model, groups, optim_files)
            if fill is not None:
                files += [f for d in range(self.dp) for f in
                          sorted(nvme_swap.swap_folder(self.path, d).glob("*.swp"))]
            return _Rank(m, files, shapes,
                         zero3_reader(groups, osds, optim_files, self.what, fill))
        zero = Zero12(groups, osds, optim_files, self.dp, self.what)
        if any(zero.moe) and self.stage not in (1, 2):
            raise CheckpointError(f"{model_files[0]}: expert groups under ZeRO-{self.stage}.")
        return _Rank(m, files, shapes, zero.dense_reader(), zero)

    def _swapped_reader(self, model: dict, groups: list[dict], optim_files: list[Path]
                        ) -> Callable[[int, list[torch.Tensor]], list[torch.Tensor]] | None:
        """ZeRO-3 with the optimizer on NVMe (mp = 1, so dp rank d is global rank d): file d's
        sub groups with the swapped ones read from ``offloaded_tensors/rank<d>``."""
        zero = (model.get("ds_config") or {}).get("zero_optimization") or {}
        if not nvme_swap.offloads_optimizer(zero):
            return None
        listed = [n for g in groups for n in g]  # param group order; module order below
        module = model.get("module") or {}
        names = set(listed)
        order = [n for n in module if n in names] if names <= module.keys() else listed
        size = int(zero.get("sub_group_size") or nvme_swap.DEFAULT_SUB_GROUP_SIZE)

        def fill(d: int, flats: list[torch.Tensor]) -> list[torch.Tensor]:
            return nvme_swap.fill_swapped(
                flats, groups=groups, order=order, dp=self.dp, sub_group_size=size,
                folder=nvme_swap.swap_folder(self.path, d), what=self.what, file=optim_files[d])
        return fill

    def expert_reader(self, m: int, ep_rank: int, etp_rank: int
                      ) -> Callable[[str], torch.Tensor]:
        """Parameters of mp rank ``m``'s expert groups as held by (ep_rank, etp_rank): the
        expert partitions of the files of m's pipeline stage at that position, in edp order."""
        zero = self.ranks[m].zero12
        if zero is None:
            raise CheckpointError(f"{self.path}: no ZeRO 1/2 partitions for experts.")
        pp_rank = m // self.tp
        parts: dict[int, tuple[Path, list[torch.Tensor]]] = {}
        for tp_rank in range(self.tp):
            other = self.ranks[pp_rank * self.tp + tp_rank].zero12
            for d in range(self.dp):
                t, e, x = self.expert_position(tp_rank, d)
                if (t, e) == (etp_rank, ep_rank):
                    parts[x] = (other.files[d], other.flats[d])
        if sorted(parts) != list(range(self.edp)):
            raise CheckpointError(f"{self.path}: expert partitions of ep rank {ep_rank} found "
                                  f"for edp ranks {sorted(parts)}, expected {self.edp}.")
        ordered = [parts[x] for x in range(self.edp)]
        return zero.expert_reader([f for f, _ in ordered], [p for _, p in ordered], self.edp)

    def coord(self, m: int, ep_rank: int | None = None, etp_rank: int | None = None) -> Coord:
        """mp rank m's position; its experts as the dp rank 0 file holds them unless given."""
        t, e, _ = self.expert_position(m % self.tp, 0)
        return Coord(tp_rank=m % self.tp, tp=self.tp, pp_rank=m // self.tp, pp=self.pp,
                     vpp=self.vpp, ep_rank=e if ep_rank is None else ep_rank, ep=self.ep,
                     etp_rank=t if etp_rank is None else etp_rank, etp=self.etp)


def hf_config_candidates(ckpt: DeepSpeedCheckpoint) -> list[Path]:
    """Where the HF config of a DeepSpeed checkpoint may be, in order: the ``hf_config/`` folder
    mdtk's trainer stores in each checkpoint (``megatron_layout.write_hf_config``),
    trainer_state.json's ``model.path`` / ``model.config`` (older trainer checkpoints; a
    relative path is taken as given, then against the run folder), else beside the engine
    folder (HF Trainer's ``checkpoint-N/``)."""
    model = (ckpt.state.get("config") or {}).get("model") or {}
    run = ckpt.path.parent.parent.parent  # <run>/checkpoints/step_N/engine
    out: list[Path] = [ckpt.path.parent / HF_CONFIG_DIR]
    for key in ("path", "config"):
        value = model.get(key)
        if not value:
            continue
        p = Path(value)
        for cand in ([p] if p.is_absolute() else [p, run / p]):
            out.append(cand.parent if cand.name.endswith(".json") else cand)
    return [*out, ckpt.path.parent, ckpt.path.parent.parent]


def _hf_config_dir(ckpt: DeepSpeedCheckpoint) -> Path | None:
    """The first of ``hf_config_candidates`` holding a config.json."""
    return next((p for p in hf_config_candidates(ckpt) if (p / CONFIG).is_file()), None)


class HFNamedSource:
    """A plain DeepSpeed checkpoint of an HF model (HF Trainer + DeepSpeed: the module is the
    transformers model, so parameters carry their HF names; one model-parallel rank): the fp32
    weights merged from the ZeRO partitions, as DeepSpeed's ``zero_to_fp32`` merges them."""

    def __init__(self, ckpt: DeepSpeedCheckpoint):
        if len(ckpt.ranks) != 1:
            raise CheckpointError(f"{ckpt.path}: {len(ckpt.ranks)} model-parallel ranks with HF "
                                  "parameter names; only mp_world_size 1 is read.")
        self._rank = ckpt.ranks[0]
        self._last: tuple[str, torch.Tensor] | None = None

    @property
    def names(self) -> list[str]:
        return list(self._rank.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._rank.shapes[name])

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def read(self, name: str, region: Any) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = (name, self._rank.read(name))
        return self._last[1][tuple(slice(a, b) for a, b in region)]

    def close(self) -> None:
        self._last = None


def open_source(path: Path, make_adapter: formats.AdapterFactory, state: str = "fp32"
                ) -> Opening:
    """A DeepSpeed checkpoint (of mdtk's trainer, or plain DeepSpeed of an HF model, as HF
    Trainer writes it) as an HF-named source, its adapter
    (``make_adapter(hf_dir, common)``) and info (the ``formats`` opener); ``state`` picks the
    fp32 master weights or an Adam moment (``STATES``)."""
    ckpt = DeepSpeedCheckpoint.open(path, state)
    adapter = make_adapter(_hf_config_dir(ckpt), {
        "iteration": ckpt.step, "root": ckpt.path.parent,
        "looked_for": [str(p) for p in hf_config_candidates(ckpt)]})
    info = {"iteration": ckpt.step, "folder": ckpt.path,
            "layout": {"tp": ckpt.tp, "pp": ckpt.pp, "vpp": ckpt.vpp if ckpt.vpp > 1 else None,
                       "cp": ckpt.cp, "dp": ckpt.dp // ckpt.cp, "ep": ckpt.ep, "etp": ckpt.etp,
                       "zero": ckpt.stage},
            "files": sorted(str(f.relative_to(ckpt.path)) for f in ckpt.files)}
    if "embedding.word_embeddings.weight" not in ckpt.ranks[0].shapes:
        return Opening(HFNamedSource(ckpt), adapter, info)  # plain DeepSpeed of an HF model
    if ckpt.ep > 1 and not adapter.dims.experts:
        raise CheckpointError(f"{ckpt.path}: saved with ep={ckpt.ep}, but "
                              f"{adapter.architecture} has no experts.")
    emb = ckpt.ranks[0].shapes["embedding.word_embeddings.weight"]  # first stage, tp rank 0
    padded = emb[0] * ckpt.tp
    table = adapter.table_at(padded)
    rules = dict(table.items())
    full_rules = dict(adapter.table_at(adapter.dims.vocab).items())
    holders: dict[str, dict[int, tuple[int, str, int, int]]] = {}
    readers: dict[tuple[int, int, int], Callable[[str], torch.Tensor]] = {}
    for m, rank in ckpt.ranks.items():
        plans = plan_rank(table, ckpt.coord(m))
        names = {(_param_name(t.chunk, t.name, ckpt.vpp)): t for t in plans}
        experts = {n for n, t in names.items() if f".{EXPERTS}." in f".{t.name}"}
        in_groups = rank.zero12.expert_names if rank.zero12 else set()
        if in_groups and in_groups != experts:
            odd = sorted(in_groups ^ experts)
            raise CheckpointError(f"{rank.files[0]}: DeepSpeed's expert groups and the "
                                  f"{adapter.architecture} mapping's experts differ: "
                                  f"{', '.join(odd[:8])}.")
        unknown = [n for n in rank.shapes if n not in names]
        held = {**{n: b.shape for n, b in rank.buffers.items() if n in names}, **rank.shapes}
        missing = [n for n in names if n not in held]
        wrong = [f"{n}: {tuple(held[n])}, expected {tuple(t.shape)}"
                 for n, t in names.items() if n in held and tuple(held[n]) != tuple(t.shape)]
        where = f"{rank.files[0]} (model-parallel rank {m} = tp {m % ckpt.tp}, pp {m // ckpt.tp})"
        if unknown:
            raise CheckpointError(f"{where} holds parameters the {adapter.architecture} mapping "
                                  f"does not use: {', '.join(unknown[:8])}.")
        if missing:
            raise CheckpointError(f"{where} lacks {', '.join(missing[:8])}.")
        if wrong:
            raise CheckpointError(f"{where}: shapes differ from the model's config: "
                                  + "; ".join(wrong[:8]))
        for n, t in names.items():
            holders.setdefault(t.key, {}).setdefault(t.shard, (m, n, 0, 0))
        if not in_groups:
            continue  # ep = etp = 1 without expert groups: plain reads
        for e in range(ckpt.ep):  # every expert position, read from its own partitions
            for et in range(ckpt.etp):
                readers[(m, e, et)] = ckpt.expert_reader(m, e, et)  # checks the partitions
                for t in plan_rank(table, ckpt.coord(m, e, et)):
                    n = _param_name(t.chunk, t.name, ckpt.vpp)
                    if n in experts:
                        holders.setdefault(t.key, {})[t.shard] = (m, n, e, et)

    def reader(m: int, e: int, et: int, name: str) -> Callable[[str], torch.Tensor]:
        if name in ckpt.ranks[m].buffers:
            return ckpt.ranks[m].buffers.__getitem__
        zero = ckpt.ranks[m].zero12
        if zero is None or name not in zero.expert_names:
            return ckpt.ranks[m].read
        return readers[(m, e, et)]

    def get(key: str) -> torch.Tensor:
        shards = {s: reader(m, e, et, n)(n) for s, (m, n, e, et) in holders[key].items()}
        hf = hf_from_shards(rules[key], shards)
        return local_tensor(full_rules[key], 0, 1, lambda n, r: hf[n][tuple(
            slice(a, b) for a, b in r)], torch.float32)

    shapes = {key: (full_rules[key].local_shape(1), torch.float32) for key in holders}
    return Opening(McoreFullSource(adapter, adapter.hf_config, shapes, get), adapter, info)


def _param_name(chunk: int, name: str, vpp: int) -> str:
    return f"{chunk}.{name}" if vpp > 1 else name


formats.register(FORMAT, open_source, looks_like)  # see toolkit.checkpoint.formats
