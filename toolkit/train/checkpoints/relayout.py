"""Offline: a trainer checkpoint rewritten as a native one at another layout
(``mdtk convert SRC DST --to trainer``), for users who reshard before they restart.

The target's ranks start on this machine (CPU, gloo), build the new layout's engine, load the
old state through ``toolkit.train.checkpoints.reshard.load_resharded`` and save it with
DeepSpeed, so that the restart at the new layout takes DeepSpeed's own load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.train.checkpoints.reshard import load_resharded, saved_stage
from toolkit.train.checkpoints.state import ENGINE_TAG, STATE_FILE, ResumeError
from toolkit.train.loop.zero3_release import destroy_engine


def convert_checkpoint(src: str | Path, dst: str | Path, *, tp: int = 1, pp: int = 1,
                       vpp: int | None = None, ep: int = 1, etp: int | None = None,
                       dp: int | None = None, zero: int | None = None,
                       overwrite: bool = False) -> Path:
    """Rewrite the trainer checkpoint ``src`` (a ``step_*`` folder, or a checkpoint root: its
    latest) as a native one at another layout under the checkpoint root ``dst``.

    Starts the target's ranks on this machine (CPU, gloo: tp * pp * dp processes, together
    holding one copy of the model and its optimizer states), builds the engine of the new
    layout, loads the old state with ``load_resharded`` and saves it with DeepSpeed, so that
    ``checkpoint.resume`` at the new layout takes DeepSpeed's own load. ``dp`` defaults to the
    saved world size over the new model-parallel size, ``zero`` to the saved stage. Returns
    the new ``step_*`` folder.
    """
    from toolkit.runtime.rankpool import RankPool
    from toolkit.train.checkpoints.folders import CheckpointManager
    from toolkit.train.checkpoints.state import load_training_state

    path = Path(src)
    if not (path / STATE_FILE).is_file():
        path = CheckpointManager(path).latest() or path
    saved = load_training_state(path)
    raw = dict(saved.config)
    mp = tp * pp * int((raw.get("parallel") or {}).get("cp") or 1)
    world = mp * (dp or max(saved.world_size // mp, 1))
    parallel = {**(raw.get("parallel") or {}), "tp": tp, "pp": pp, "vpp": vpp, "ep": ep,
                "etp": etp}
    deepspeed = {**(raw.get("deepspeed") or {}),
                 "zero_stage": saved_stage(path) if zero is None else zero}
    raw.update(parallel=parallel, deepspeed=deepspeed,
               checkpoint={**(raw.get("checkpoint") or {}), "dir": str(dst),
                           "resume": str(path)})
    final = Path(dst) / path.name
    if final.exists() and not overwrite:
        raise ResumeError(f"{final} exists: choose another destination or overwrite.")
    _check_target(raw, world, saved.global_batch, path)  # here: one clear error, not N
    with RankPool(world) as pool:
        out = pool.run(_convert_rank, raw, str(path), timeout=3600)
    return Path(out[0])


def _check_target(raw: dict[str, Any], world: int, global_batch: int, src: Path) -> None:
    """The new layout fits the model config and keeps the global batch (the data position)."""
    from toolkit import parallel
    from toolkit.train import config as cfgmod

    plan = cfgmod.plan(cfgmod.config_from_dict(raw), world)
    parallel.check_supported(plan.layout)
    if plan.global_batch != global_batch:
        raise ResumeError(f"{src}: trained with global batch {global_batch}, the new layout "
                          f"gives {plan.global_batch}: keep train.global_batch.")


def _convert_rank(raw: dict[str, Any], src: str) -> str:
    """One rank of ``convert_checkpoint``: engine at the new layout, resharded load, save."""
    import dataclasses

    import torch.distributed as dist

    from toolkit import parallel
    from toolkit.checkpoint.megatron_layout import HF_CONFIG_DIR, write_hf_config
    from toolkit.train import config as cfgmod
    from toolkit.train.checkpoints.folders import CheckpointManager
    from toolkit.train.checkpoints.state import load_training_state
    from toolkit.train.ds_config import deepspeed_config
    from toolkit.train.loop.engine import build_engine, mask_vocab_padding
    from toolkit.train.model import RunModel, build_model

    cfg = cfgmod.config_from_dict(raw)
    saved = load_training_state(src)
    plan = cfgmod.plan(cfg, dist.get_world_size())
    layout = plan.layout
    model = RunModel.of(cfg)
    mpu = parallel.initialize(layout, seed=cfg.train.seed)
    engine = None
    try:
        ds_config, _ = deepspeed_config(cfg, plan, model, cfg.train.steps or saved.step)
        chunks, adapter = build_model(cfg, layout, model)
        mask_vocab_padding(chunks, adapter.dims.vocab)
        engine = build_engine(chunks, mpu, ds_config, checked=True)
        load_resharded(src, engine, list(chunks), adapter, saved.step, saved.consumed_samples)
        state = dataclasses.replace(saved, world_size=layout.world_size, dp_size=layout.dp,
                                    layout=dataclasses.asdict(layout), config=cfg.to_dict())
        # the new checkpoint describes its model as the source did (tokenizer files included)
        folders = [Path(src) / HF_CONFIG_DIR, *(Path(p) for p in (cfg.model.path,
                   cfg.tokenizer_path) if p and Path(p).is_dir())]
        manager = CheckpointManager(cfg.checkpoint_dir, describe=lambda d: write_hf_config(
            d, model.spec.write, [f for f in folders if f.is_dir()]))
        return str(manager.save(
            state, lambda d: engine.save_checkpoint(str(d), tag=ENGINE_TAG, save_latest=False)))
    finally:
        if engine is not None:
            destroy_engine(engine)
        parallel.destroy()
