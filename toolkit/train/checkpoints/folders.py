"""The checkpoint folders of a training run: publication, lookup with verification, pruning.

Layout of ``checkpoint.dir``::

    step_0000010/
        engine/                 DeepSpeed engine checkpoint (model, optimizer, ZeRO partitions)
        rng/rank_00000.pt       RNG states of each global rank (python, numpy, torch, CUDA, mcore)
        hf_config/              config.json, generation_config.json and the tokenizer files of
                                the model: inspect, convert and verify need nothing else
        trainer_state.json      step, consumed samples, dp, layout, data fingerprint, config
        latest                  "engine": DeepSpeed's own tag pointer, so its tools (zero_to_fp32,
                                get_fp32_state_dict_from_zero_checkpoint) work without a tag
        manifest.json           every file above with its size and xxh3-128 checksum
    latest                      "step_0000010", written last (for people and external tools)

A save is collective. ``begin`` makes ``.tmp-step_0000010`` (rank 0, with ``hf_config/``); every
rank writes its files into it (``toolkit.train.checkpoints.saver``: at once, or from a host copy
while the steps go on); once the ranks agree that every file is written, ``publish`` (rank 0)
hashes the files no rank recorded, writes ``trainer_state.json`` and ``manifest.json``, fsyncs,
renames the folder to ``step_0000010`` and then rewrites ``latest``; a failed save's folder is
removed (``abandon``). A folder named ``step_*`` therefore only ever exists complete; a crash
leaves at most a ``.tmp-*`` folder, which resume ignores and the next save removes. Pruning
renames a folder away before deleting it, so a half-deleted checkpoint never looks complete
either.

Resume verifies before it loads: each rank checks its share of the files against the manifest
(sizes, and xxh3-128 checksums unless ``checksums=False``) and the ranks pool what they found.
Assumes ``checkpoint.dir`` is one shared filesystem for all ranks (as DeepSpeed does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from toolkit.checkpoint import manifest
from toolkit.checkpoint.deepspeed import ENGINE_TAG, STATE_FILE
from toolkit.train.checkpoints.state import ResumeError, TrainingState, save_rng

_STEP_RE = re.compile(r"^step_(\d{7,})$")
TMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


# -- collectives (no-ops without a process group) ----------------------------------------------
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def rank_and_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)


def from_rank0(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank."""
    dist = _dist()
    if dist is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_all(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    dist = _dist()
    if dist is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_problems(problems: Sequence[manifest.Problem], limit: int = 3) -> str:
    text = "; ".join(str(p) for p in problems[:limit])
    return text + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")


class CheckpointManager:
    """Finds, publishes, verifies and prunes the checkpoints under ``root``.

    ``keep_last=0`` keeps all; ``keep_every=N`` never prunes a step divisible by N.
    ``describe(folder)`` (rank 0, at ``begin``) adds the files that make a checkpoint
    self-contained (the model's HF config and tokenizer). ``begin``, ``publish``, ``save``,
    ``verify`` and ``resolve_resume`` are collective (call them on every rank); the lookups are
    local and cheap."""

    def __init__(self, root: str | Path, keep_last: int = 0, keep_every: int = 0,
                 describe: Callable[[Path], None] | None = None):
        if keep_last < 0 or keep_every < 0:
            raise ResumeError(f"checkpoint.keep_last={keep_last} and checkpoint.keep_every="
                              f"{keep_every} must be >= 0.")
        self.root = Path(root)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.describe = describe

    def path_for(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and (p / STATE_FILE).is_file():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    # -- saving ---------------------------------------------------------------------------------
    def begin(self, step: int) -> tuple[Path, str | None]:
        """The temporary folder of step ``step``'s save, made by rank 0 (a leftover of an
        interrupted save removed, ``describe`` run), and rank 0's error if that failed."""
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}"
        error = None
        if rank_and_world()[0] == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
                if self.describe is not None:
                    self.describe(tmp)
            except OSError as e:
                error = f"preparing {tmp} failed ({type(e).__name__}: {e})"
        return tmp, from_rank0(error)

    def publish(self, state: TrainingState, tmp: Path,
                records: Iterable[manifest.FileRecord] = ()) -> tuple[Path, str | None]:
        """Make the complete ``tmp`` the checkpoint of ``state.step`` (rank 0; every rank gets
        the final folder and rank 0's error, if publishing failed: the folder then stays
        temporary). ``records``: the files the ranks wrote and hashed; rank 0 hashes the rest."""
        final = self.path_for(state.step)
        error = None
        if rank_and_world()[0] == 0:
            try:
                self._publish(state, tmp, final, list(records))
            except OSError as e:
                error = f"publishing {tmp} failed ({type(e).__name__}: {e})"
        return final, from_rank0(error)

    def _publish(self, state: TrainingState, tmp: Path, final: Path,
                 records: list[manifest.FileRecord]) -> None:
        if (tmp / ENGINE_TAG).is_dir():  # as engine.save_checkpoint(save_latest=True) writes it
            (tmp / "latest").write_text(ENGINE_TAG)
        (tmp / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=1))
        known = {r.path for r in records}
        for dirpath, _, files in os.walk(tmp):
            for name in files:
                path = Path(dirpath) / name
                if path.relative_to(tmp).as_posix() not in known:
                    _fsync(path)
                    records.append(manifest.record(tmp, path))
        manifest.write(tmp, records)
        for dirpath, _, _ in os.walk(tmp):
            _fsync(Path(dirpath))
        if final.exists():  # re-saving a step (e.g. after a resume): replace it
            self._remove(final)
        os.rename(tmp, final)
        pointer = self.root / "latest.tmp"
        pointer.write_text(final.name + "\n")
        _fsync(pointer)
        os.replace(pointer, self.root / "latest")
        _fsync(self.root)
        self.prune()

    def abandon(self, tmp: Path) -> None:
        """Remove a failed save's temporary folder (rank 0; the earlier checkpoints stay)."""
        if rank_and_world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def save(self, state: TrainingState, write_engine: Callable[[Path], None] | None = None,
             ) -> Path:
        """A synchronous collective save of step ``state.step``; returns the final folder.

        ``write_engine(folder)`` runs on every rank, e.g.
        ``lambda d: engine.save_checkpoint(str(d), tag=ENGINE_TAG, save_latest=False)``; its
        files are hashed at publication. (The trainer saves through
        ``toolkit.train.checkpoints.saver``.)"""
        tmp, error = self.begin(state.step)
        if error is None:
            if write_engine is not None:
                write_engine(tmp)
            save_rng(tmp, rank_and_world()[0])
            barrier()
            final, error = self.publish(state, tmp)
        if error is not None:
            self.abandon(tmp)
            raise ResumeError(f"checkpoint of step {state.step} not saved: {error}")
        barrier()
        return final

    def prune(self) -> list[Path]:
        """Delete the complete checkpoints that are neither among the newest ``keep_last`` nor
        at a multiple of ``keep_every``, and any leftover temporary folder of an interrupted save
        (call on one rank, outside a save)."""
        removed = []
        for p in self.root.glob(f"{TMP_PREFIX}step_*"):
            self._remove(p)
        if self.keep_last:
            done = self.complete()
            newest = {step for step, _ in done[-self.keep_last:]}
            for step, p in done:
                if step in newest or (self.keep_every and step % self.keep_every == 0):
                    continue
                self._remove(p)
                removed.append(p)
        return removed

    def _remove(self, path: Path) -> None:
        doomed = path.parent / f".deleting-{path.name}"
        if doomed.exists():
            shutil.rmtree(doomed)
        os.rename(path, doomed)  # no longer a step_* folder from here on
        shutil.rmtree(doomed)

    # -- resuming -------------------------------------------------------------------------------
    def verify(self, path: Path, *, checksums: bool = True) -> list[manifest.Problem]:
        """The problems of checkpoint ``path`` against its manifest, the files split among the
        ranks (collective); [] for an intact one and for one without a manifest."""
        rank, world = rank_and_world()
        mine = manifest.verify(path, checksums=checksums, part=rank, parts=world)
        found = [p for part in gather_all(mine) for p in part]
        return sorted(found, key=lambda p: p.path)

    def resolve_resume(self, resume: str, *, checksums: bool = True,
                       warn: Callable[[str], None] = print) -> Path | None:
        """``auto``: the newest complete checkpoint that is intact (None for a fresh run; a
        damaged one is skipped with a warning naming its files); ``none``: None; otherwise the
        folder given, which must be complete and intact (collective: verification)."""
        if resume == "none":
            return None
        if resume != "auto":
            return self._named(Path(resume), checksums)
        damaged = []
        for _, path in reversed(self.complete()):
            problems = self.verify(path, checksums=checksums)
            if not problems:
                self._unverified(path, warn)
                return path
            damaged.append(path.name)
            warn(f"checkpoint {path} is damaged ({describe_problems(problems)}): skipped, "
                 "trying the one before it.")
        if damaged:
            raise ResumeError(f"every checkpoint under {self.root} is damaged ({', '.join(damaged)}"
                              "): restore the files named above, or start fresh with "
                              "checkpoint.resume=none.")
        return None

    def _named(self, path: Path, checksums: bool) -> Path:
        if not (path / STATE_FILE).is_file():
            raise ResumeError(f"checkpoint.resume={str(path)!r} is not a complete checkpoint "
                              f"(no {STATE_FILE}); complete ones under {self.root}: "
                              f"{[p.name for _, p in self.complete()] or 'none'}.")
        problems = self.verify(path, checksums=checksums)
        if problems:
            others = [p.name for _, p in self.complete() if p != path]
            raise ResumeError(
                f"checkpoint.resume={str(path)!r} is damaged: {describe_problems(problems)}. "
                "Restore the file from a copy, or resume from another checkpoint"
                + (f" ({', '.join(others)} under {self.root})" if others else "") + ".")
        return path

    @staticmethod
    def _unverified(path: Path, warn: Callable[[str], None]) -> None:
        if not (path / manifest.MANIFEST).is_file():
            warn(f"checkpoint {path} has no {manifest.MANIFEST} (saved by an older mdtk): "
                 "its files are not verified.")
