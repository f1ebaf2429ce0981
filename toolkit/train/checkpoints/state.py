"""What a training checkpoint holds besides DeepSpeed's engine files: the trainer state (step,
data position, layout, config), each rank's RNG states, and the checks that a resume continues
the same run. The folders themselves (publication, lookup, verification, pruning) are
``toolkit.train.checkpoints.folders``; the save protocol is ``toolkit.train.checkpoints.saver``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The folder names of a trainer checkpoint belong to its format (the converter reads them too):
# engine.save_checkpoint(step_dir, tag=ENGINE_TAG, save_latest=False); STATE_FILE beside it.
from toolkit.checkpoint.deepspeed import ENGINE_TAG, STATE_FILE  # noqa: F401 - the trainer's names
from toolkit.errors import UserError

FORMAT_VERSION = 1


class ResumeError(UserError):
    """A training checkpoint that cannot be resumed (or kept) as asked; the message says why
    and what to do. Not ``toolkit.checkpoint``'s CheckpointError, which is about reading and
    writing model checkpoint formats."""


@dataclass
class TrainingState:
    """What the trainer needs besides the engine to continue exactly where it stopped."""

    step: int  # optimizer steps completed
    consumed_samples: int
    world_size: int
    dp_size: int
    global_batch: int
    micro_batch: int
    seed: int
    layout: dict[str, Any]  # dataclasses.asdict(ParallelLayout)
    data_fingerprint: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # the resolved TrainConfig.to_dict()
    format: int = FORMAT_VERSION
    complete: bool = True


def load_training_state(ckpt_dir: str | Path) -> TrainingState:
    path = Path(ckpt_dir) / STATE_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResumeError(
            f"{ckpt_dir} is not a complete mdtk checkpoint ({path.name}: {e}).") from e
    if raw.get("format") != FORMAT_VERSION:
        raise ResumeError(f"{path}: format {raw.get('format')!r}, this mdtk reads "
                              f"{FORMAT_VERSION}.")
    known = {f.name for f in dataclasses.fields(TrainingState)}
    return TrainingState(**{k: v for k, v in raw.items() if k in known})


# -- RNG ---------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """RNG states of python, numpy, torch CPU, CUDA (when present) and megatron-core's
    model-parallel tracker (when megatron-core is loaded), as tensors/ints/tuples only, so the
    file loads with ``torch.load(weights_only=True)``."""
    import numpy as np
    import torch

    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _mcore_tracker()
    if tracker is not None:
        state["mcore"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(_tuplify(state["python"]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            raise ResumeError(f"checkpoint holds CUDA RNG states of {len(state['cuda'])} "
                                  f"devices, this process sees {torch.cuda.device_count()}.")
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _mcore_tracker()
    if tracker is not None and state.get("mcore"):
        tracker.set_states(state["mcore"])


def _tuplify(x: Any) -> Any:
    # random.setstate needs tuples; a round trip through pickle keeps them, be lenient anyway.
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def _mcore_tracker():
    if "megatron.core" not in sys.modules:
        return None
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    return tracker if tracker.get_states() else None


def rng_file(ckpt_dir: str | Path, rank: int) -> Path:
    return Path(ckpt_dir) / "rng" / f"rank_{rank:05d}.pt"


def save_rng(ckpt_dir: str | Path, rank: int) -> None:
    import torch

    path = rng_file(ckpt_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(capture_rng_state(), path)


def load_rng(ckpt_dir: str | Path, rank: int) -> bool:
    """Restore this rank's RNG states; False when the checkpoint has none for ``rank`` (it was
    saved with fewer ranks: the trainer then reseeds, and only dropout-like randomness differs)."""
    import torch

    path = rng_file(ckpt_dir, rank)
    if not path.is_file():
        return False
    restore_rng_state(torch.load(path, map_location="cpu", weights_only=True))
    return True


# -- resume compatibility ----------------------------------------------------------------------
_MODEL_PARALLEL_KEYS = ("tp", "pp", "vpp", "cp", "ep", "etp")


def check_resume(state: TrainingState, *, layout, global_batch: int, seed: int,
                 data_fingerprint: str | None, dp_change_ok: bool,
                 reshard_ok: bool = False) -> None:
    """Refuse a resume that cannot continue the same run; each message names the fix.

    ``dp_change_ok``: whether both the data sampler and the engine checkpoint can continue at
    another dp size (``GlobalBatchSampler.supports_dp_change`` is True; the trainer adds what
    its engine can reshard). ``reshard_ok``: the engine state is resharded to this layout
    (``toolkit.train.checkpoints.reshard``), so another model-parallel layout is accepted too."""
    where = f"checkpoint at step {state.step}"
    if state.global_batch != global_batch:
        raise ResumeError(
            f"{where} was trained with train.global_batch={state.global_batch}, this run has "
            f"{global_batch}: the data order and LR schedule are defined per global batch. Set "
            f"train.global_batch={state.global_batch} or start fresh with checkpoint.resume=none.")
    if state.seed != seed:
        raise ResumeError(f"{where} used train.seed={state.seed}, this run {seed}: the data "
                              f"order would change. Set train.seed={state.seed} or "
                              "checkpoint.resume=none.")
    if (state.data_fingerprint and data_fingerprint
            and state.data_fingerprint != data_fingerprint):
        raise ResumeError(
            f"{where} was trained on other data or tokenisation (fingerprint "
            f"{state.data_fingerprint} vs {data_fingerprint}: sources, tokenizer, seq_len or data "
            "settings changed). Restore them or start fresh with checkpoint.resume=none.")
    saved = {k: state.layout.get(k) for k in _MODEL_PARALLEL_KEYS}
    now = {k: getattr(layout, k) for k in _MODEL_PARALLEL_KEYS}
    if saved != now and not reshard_ok:
        diff = ", ".join(f"{k}: {saved[k]} -> {now[k]}" for k in saved if saved[k] != now[k])
        raise ResumeError(
            f"{where} was saved with another model-parallel layout ({diff}); the engine "
            "checkpoint holds per-rank shards of that layout. Resume with the saved layout, or "
            "convert the checkpoint to the new layout first.")
    if state.dp_size != layout.dp and not dp_change_ok:
        raise ResumeError(
            f"{where} was saved at dp={state.dp_size}, this run has dp={layout.dp}, and this "
            "engine configuration cannot continue at another dp size. Launch "
            f"{state.dp_size * layout.model_parallel} ranks, or start fresh with "
            "checkpoint.resume=none.")
