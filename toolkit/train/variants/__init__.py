"""What a run trains, as types behind one protocol, so the loop has no branch for either:

- ``FullWeights``: every weight of the model. Checkpoints are DeepSpeed's, written by the run's
  ``Saver`` (synchronous or asynchronous); a resume at another layout or ZeRO stage reshards
  them through the mapping (``train.reshard``); the export is an HF folder.
- ``RewardWeights``: every weight of a reward model (``FullWeights`` with a score head in
  place of the LM head); the export is an HF sequence-classification folder.
- ``LoraWeights``: LoRA / DoRA adapters on a frozen base (``train.lora``). Checkpoints hold the
  adapters and their optimizer state as full HF-named tensors, written synchronously (they are
  small) and read back at any layout; the export is a PEFT folder and the merged model.

A new way to train (another adapter method, a frozen part) is one more class here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.errors import ConfigError
from toolkit.train.run_state import (
    RunState,
    TrainResult,
    Variant,
    describe_layout,
    log,
    reseed_unless_restored,
)
from toolkit.train.variants import lora

if TYPE_CHECKING:
    from toolkit.adapters import Adapter
    from toolkit.lora import LoraSpec
    from toolkit.train.checkpoints.saver import Saver
    from toolkit.train.checkpoints.state import TrainingState
    from toolkit.train.config import TrainConfig

__all__ = ["FullWeights", "LoraWeights", "RewardWeights", "Variant", "variant_for"]


def variant_for(cfg: TrainConfig) -> Variant:
    """The run's variant (before ``attach``)."""
    if cfg.data.mode == "reward":
        return RewardWeights()
    return FullWeights() if cfg.peft.method == "none" else LoraWeights()


@dataclass(frozen=True)
class FullWeights:
    uses_saver = True

    def attach(self, cfg: TrainConfig, chunks: list[Any], adapter: Adapter) -> FullWeights:
        return self

    def save(self, state: RunState, engine: Any, saver: Saver, step: int) -> Path | None:
        return saver.save(engine, state.training_state(step))

    def resume(self, state: RunState, engine: Any, path: Path, saved: TrainingState) -> str:
        from toolkit.train.checkpoints import reshard
        from toolkit.train.checkpoints.state import ENGINE_TAG

        lora.refuse_adapters_for_full_run(path)
        # Another layout (or ZeRO stage): resharded through the mapping; the same one:
        # DeepSpeed's native load of its per-rank shards.
        stage = reshard.saved_stage(path)
        native = (reshard.same_layout(saved.layout, state.plan.layout)
                  and stage == engine.zero_optimization_stage())
        if native:
            loaded, _ = engine.load_checkpoint(str(path), tag=ENGINE_TAG)
            if loaded is None:
                raise ConfigError(f"checkpoint {path}: DeepSpeed found no engine state under "
                                  f"tag {ENGINE_TAG!r} (incomplete or foreign checkpoint).")
        else:
            reshard.load_resharded(path, engine, state.chunks, state.adapter, saved.step,
                                   saved.consumed_samples)
        reseed_unless_restored(path, state.cfg.train.seed, saved.step, native)
        how = "" if native else f" (resharded from {describe_layout(saved.layout)}, ZeRO-{stage})"
        return f"resumed from {path} at step {saved.step}{how}"

    def export(self, state: RunState, engine: Any, result: TrainResult) -> None:
        from toolkit.train.variants.export import export

        cfg = state.cfg
        if not cfg.export.hf_dir:
            return
        result.export_dir, result.export_max_abs_diff = export(
            state.chunks, state.adapter, cfg.export.hf_dir, verify=cfg.export.verify)
        if result.export_dir is not None:
            diff = result.export_max_abs_diff
            log(f"exported HF checkpoint to {result.export_dir}"
                + (f" (logits vs trained model: max abs diff {diff:.2e})" if cfg.export.verify
                   else ""))


@dataclass(frozen=True)
class RewardWeights(FullWeights):
    """Every weight of a reward model (the backbone and its score head); the export is an HF
    sequence-classification folder (``variants.reward``)."""

    def export(self, state: RunState, engine: Any, result: TrainResult) -> None:
        from toolkit.train.variants.reward import export_reward

        cfg = state.cfg
        if not cfg.export.hf_dir:
            return
        result.export_dir, result.export_max_abs_diff = export_reward(
            state.chunks, state.adapter, cfg.export.hf_dir,
            state.data.meta.get("pad_id"), verify=cfg.export.verify)
        if result.export_dir is not None:
            diff = result.export_max_abs_diff
            log(f"exported the reward model to {result.export_dir} (AutoModelForSequence"
                "Classification)" + (f" (scores vs trained model: max abs diff {diff:.2e})"
                                     if cfg.export.verify else ""))


@dataclass(frozen=True)
class LoraWeights:
    spec: LoraSpec | None = None  # with the targets resolved, once attached
    uses_saver = False

    def attach(self, cfg: TrainConfig, chunks: list[Any], adapter: Adapter) -> LoraWeights:
        return LoraWeights(lora.attach_adapters(cfg, chunks, adapter))

    def save(self, state: RunState, engine: Any, saver: Saver, step: int) -> Path:
        from toolkit.train.loop import faults

        def write_engine(folder: Path) -> None:  # the adapters and their optimizer state only
            lora.save_state(folder, engine, state.chunks, state.adapter, self._spec,
                            state.cfg.model.path)
            faults.test_hook("save", step)  # tests kill a rank here, mid-save

        path = state.checkpoints.save(state.training_state(step), write_engine)
        log(f"saved checkpoint {path}")
        return path

    def resume(self, state: RunState, engine: Any, path: Path, saved: TrainingState) -> str:
        from toolkit.train.checkpoints import reshard

        lora.load_state(path, engine, state.chunks, self._spec, saved.step,
                        saved.consumed_samples)
        same = reshard.same_layout(saved.layout, state.plan.layout)
        reseed_unless_restored(path, state.cfg.train.seed, saved.step, same)
        how = "" if same else f" (from {describe_layout(saved.layout)})"
        return f"resumed adapters from {path} at step {saved.step}{how}"

    def export(self, state: RunState, engine: Any, result: TrainResult) -> None:
        if state.cfg.export.hf_dir or state.cfg.export.adapter_dir:
            lora.export(state.cfg, state.chunks, state.adapter, self._spec, result,
                        log)

    @property
    def _spec(self) -> LoraSpec:
        if self.spec is None:
            raise RuntimeError("the adapters are used before attach() put them on the model")
        return self.spec
