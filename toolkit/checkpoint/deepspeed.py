"""DeepSpeed checkpoints written by mdtk's trainer, read offline as a converter source.

Layout (``toolkit.train.checkpointing``): ``checkpoints/latest`` names ``step_XXXXXXX/``, which
holds ``trainer_state.json`` (step, layout, the resolved train config) and ``engine/``, written by
``engine.save_checkpoint(step_dir, tag="engine")``:

- ZeRO 1/2: ``mp_rank_MM_model_states.pt`` per model-parallel rank (``module`` = the rank's
  GPTModel state dict, ``param_shapes`` = parameter names and shapes per optimizer group) and
  ``zero_pp_rank_D_mp_rank_MM_optim_states.pt`` per data-parallel rank D: the fp32 master
  weights of each group flattened in ``param_shapes`` order and cut into dp equal partitions
  (``single_partition_of_fp32_groups``; ``bf16_`` prefix with DeepSpeed's bf16 optimizer).
- ZeRO 3: ``zero_pp_rank_D_mp_rank_MM_model_states.pt`` and ``..._optim_states.pt`` per dp rank;
  every parameter is split on its own into dp partitions of ceil(numel / dp) elements, which
  follow one another in each rank's ``fp32_flat_groups`` (``param_shapes`` order).

The model-parallel rank MM is megatron-core's rank in its tp x pp group (pp_rank * tp +
tp_rank); its parameters carry the chunk's local names (``<chunk>.`` prefixed with virtual
pipeline stages). DeepSpeed's own ``zero_to_fp32`` merges the dp partitions of mp rank 00 only;
here every mp rank is merged and the shards are reassembled through the adapter's mapping (the
same plans the trainer loaded the model with), so tp/pp > 1 convert to any format. Files are
loaded with ``torch.load(weights_only=True, mmap=True)`` (``safe_load.load_torch``: DeepSpeed's
loss scaler / enums become inert placeholders) and each parameter is read from the memory-mapped
partitions only when a writer asks for it.

Experts (ZeRO 1/2; the trainer refuses ZeRO-3 with experts). megatron-core's expert parameters
are DeepSpeed "MoE" parameters: ZeRO puts them in their own optimizer groups (``moe: True`` in
``base_optimizer_state.param_groups``) partitioned over the expert-data-parallel group only
(``partition_count`` = edp), while the dense groups are partitioned over dp. There are no
``layer_*_expert_*`` / ``expp_rank_*`` files (DeepSpeed writes those for its own MoE modules and
for ZeRO-0 only), and ``mp_rank_MM_model_states.pt`` is written by dp rank 0 alone: its
``module`` and ``param_shapes`` hold the local experts of *that* rank's expert-parallel rank. So
with ep > 1 the only copy of the other ep ranks' experts is the expert group of their
``zero_pp_rank_D`` files. File D is dp rank D of mp rank MM; megatron-core orders the dp x tp
block of a stage as tp-dp for dense groups and etp-ep-edp for experts, so block index
b = tp_rank + tp * D is expert-TP rank b % etp, ep rank (b // etp) % ep and edp rank
b // (etp * ep). An expert tensor of (ep rank, etp rank) is the concatenation, in edp order, of
the expert groups of those files, cut at its ``param_shapes`` offset; its local name
``local_experts.<e>`` becomes global expert ``ep_rank * experts / ep + e`` through the
adapter's plan (``plan_rank`` with that coordinate).

Context parallelism (cp > 1): CP ranks hold the same weights, and DeepSpeed's data-parallel group
is megatron-core's dp x cp group (the trainer's mpu), so ``dp_world_size`` and the
``zero_pp_rank_D`` files count dp x cp ranks: ZeRO partitions over all of them, file D being cp
rank D % cp of dp rank D // cp (tp-cp-dp order, cp inside dp). The dense partitions concatenate
in D order as at cp = 1, and the expert position above holds with D over dp x cp (the stage's
tp x cp x dp block is etp-ep-edp for experts: cp folds into ep x edp).

Persistent buffers (DeepSeek's router ``expert_bias``, HF's ``e_score_correction_bias``) are
not parameters: no optimizer group holds them, so they are in no ZeRO partition and not in
``param_shapes``. DeepSpeed saves them only in the module state dict of the model-states file
(``module``, listed in ``buffer_names``); they are read from there (``_Rank.buffers``). The
trainer does not update them (no aux-loss-free bias update), so every dp / ep rank holds the
same copy; their Adam moments are zero (they are never stepped).

Adam moments: ``open(path, state="exp_avg")`` (or ``"exp_avg_sq"``) reads the optimizer's
moments instead of the fp32 master weights. They are elementwise, so they sit at the same offsets
as the fp32 partitions: ZeRO 1/2 ``base_optimizer_state`` (``state[g]`` per group), ZeRO 3
``optimizer_state_dict.state[g]`` (per sub group, beside ``fp32_flat_groups[g]``), ZeRO 0 the
torch optimizer's ``state[i]`` of the i-th parameter in ``param_shapes`` order. The trainer's
resume at another layout (``toolkit.train.reshard``) reads all three through the same mapping.

Optimizer state offloaded to NVMe (ZeRO-3, tp = pp = 1): the fp32 weights and moments of the
swapped sub groups are read from the swap files DeepSpeed copies into the checkpoint
(``toolkit.checkpoint.nvme_swap``). Parameters offloaded to NVMe need nothing more: DeepSpeed
copies no parameter swap files, and needs none, since the optimizer's fp32 partitions (in its
files or its swap files) are the complete master weights the parameters are copied from.

Not supported (refused with a message): optimizer NVMe offload at tp or pp > 1 (swap folders
are filed by global rank); experts with ep > 1 under ZeRO 0 (DeepSpeed saves the weights of
ep rank 0's experts only) or ZeRO 3.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.checkpoint import CheckpointError, formats, nvme_swap
from toolkit.checkpoint.canonical import McoreFullSource, hf_from_shards, local_tensor
from toolkit.checkpoint.torchfree.safe_load import load_torch
from toolkit.lazy import torch
from toolkit.mapping import Coord, plan_rank
from toolkit.mapping.plan import EXPERTS

FORMAT = "deepspeed"
STATE_FILE = "trainer_state.json"
ENGINE_TAG = "engine"
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
    zero12: _Zero12 | None = None  # ZeRO 1/2: the partitions, for the expert reader
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
        rank.buffers = _buffers(model, model_files[0], self.what)
        return rank

    def _read_rank(self, m: int, model: dict, groups: list[dict], model_files: list[Path],
                   optim_files: list[Path]) -> _Rank:
        """mp rank ``m``'s parameters, read from its ZeRO partitions (or, ZeRO 0, its module)."""
        shapes = {n: torch.Size(s) for g in groups for n, s in g.items()}
        files = [*model_files, *optim_files]
        if self.stage == 0:
            return _Rank(m, files, shapes, _zero0_reader(model, groups, self.what,
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
                         _zero3_reader(groups, osds, optim_files, self.what, fill))
        zero = _Zero12(groups, osds, optim_files, self.dp, self.what)
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


STATES = ("fp32", "exp_avg", "exp_avg_sq")  # master weights, Adam's first and second moments


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


def _buffers(model: dict, file: Path, what: str) -> dict[str, torch.Tensor]:
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


def _zero0_reader(model: dict, groups: list[dict], what: str, file: Path
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
class _Zero12:
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


def _zero3_reader(groups: list[dict], osds: list[dict], files: list[Path], what: str = "fp32",
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


def hf_config_candidates(ckpt: DeepSpeedCheckpoint) -> list[Path]:
    """Where the HF config of a DeepSpeed checkpoint may be, in order: trainer_state.json's
    ``model.path`` / ``model.config`` (mdtk's trainer; a relative path is taken as given, then
    against the run folder), else beside the engine folder (HF Trainer's ``checkpoint-N/``)."""
    model = (ckpt.state.get("config") or {}).get("model") or {}
    run = ckpt.path.parent.parent.parent  # <run>/checkpoints/step_N/engine
    out: list[Path] = []
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
    return next((p for p in hf_config_candidates(ckpt) if (p / "config.json").is_file()), None)


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
                ) -> tuple[McoreFullSource | HFNamedSource, Any, dict]:
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
        return HFNamedSource(ckpt), adapter, info  # plain DeepSpeed of an HF model
    if ckpt.ep > 1 and not adapter.dims.experts:
        raise CheckpointError(f"{ckpt.path}: saved with ep={ckpt.ep}, but "
                              f"{adapter.architecture} has no experts.")
    emb = ckpt.ranks[0].shapes["embedding.word_embeddings.weight"]  # first stage, tp rank 0
    padded = emb[0] * ckpt.tp
    table = adapter.family.table(adapter.hf_config, adapter.dims, padded)
    rules = dict(table.items())
    full_rules = dict(adapter.table(1).items())
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
    return McoreFullSource(adapter, adapter.hf_config, shapes, get), adapter, info


def _param_name(chunk: int, name: str, vpp: int) -> str:
    return f"{chunk}.{name}" if vpp > 1 else name


formats.register(FORMAT, open_source, looks_like)  # see toolkit.checkpoint.formats
