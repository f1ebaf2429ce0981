"""Rank function (``run_all``, in the session's ``rank_pool_2``): every
``ds_configs/*_hf_trainer.json`` preset, as written, through the HF Trainer (``use_cpu=True``,
default TrainingArguments but lr and batch size) and through accelerate's ``DeepSpeedPlugin``
with its ``DummyOptim`` / ``DummyScheduler``; 3 steps each on the same batch, all in one job.

It returns, per preset: the 3 step losses of both runs, the loss on the same batch after them
(``after``), the HF run's learning rates and the "auto" keys left in the configs they resolved.
The presets' WarmupDecayLR starts at ``warmup_min_lr``, which both fill with 0, and its log
warmup gives lr 0 at its first step too: the first two updates change nothing, the step losses
are equal and only the third update (at the full lr) lowers the loss.

Only two edits adapt a preset to this machine: ``torch_adam`` where DeepSpeed would JIT-compile
FusedAdam (no optimizer offload), and the NVMe preset's ``nvme_path`` (one folder per rank and
run). ``nvme=False``: the NVMe preset only resolves (no engine: DeepSpeed's async_io op is
missing).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
MICRO, SEQ, STEPS, LR = 2, 32, 3, 1e-2


def _samples(world: int) -> list[dict[str, torch.Tensor]]:
    """One global batch of the bundled pretraining text, as bytes (ids < 256 < vocab 512)."""
    text = (ROOT / "toolkit/bundled/examples/data/pretrain.jsonl").read_text().splitlines()
    ids = torch.tensor(list(" ".join(json.loads(t)["text"] for t in text[:8]).encode()))
    rows = ids[: MICRO * world * SEQ].view(MICRO * world, SEQ)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ROOT / "toolkit/bundled/examples/tiny_llama_config.json")
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(config)


def for_this_machine(cfg: dict[str, Any], work: Path, run: str) -> dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    zero = cfg.get("zero_optimization", {})
    if "offload_optimizer" not in zero:
        cfg["optimizer"]["params"]["torch_adam"] = True
    for key in ("offload_optimizer", "offload_param"):
        if (zero.get(key) or {}).get("device") == "nvme":
            path = work / "nvme" / run / f"rank{int(os.environ['RANK'])}"
            path.mkdir(parents=True, exist_ok=True)
            zero[key]["nvme_path"] = str(path)
    return cfg


def _autos(cfg: Any, prefix: str = "") -> list[str]:
    if isinstance(cfg, dict):
        return [k for key, v in cfg.items() for k in _autos(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if cfg == "auto" else []


def hf_trainer(cfg: dict[str, Any], work: Path, world: int) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(work / "out"), use_cpu=True, deepspeed=cfg, max_steps=STEPS,
        per_device_train_batch_size=MICRO, per_device_eval_batch_size=MICRO, learning_rate=LR,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=1234)
    trainer = Trainer(model=_model(), args=args, train_dataset=_samples(world),
                      eval_dataset=_samples(world))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    resolved = trainer.accelerator.deepspeed_plugin.deepspeed_config
    out = {"losses": [h["loss"] for h in logs], "lrs": [h["learning_rate"] for h in logs],
           "after": trainer.evaluate()["eval_loss"], "autos": _autos(resolved),
           "betas": resolved["optimizer"]["params"]["betas"],
           "engine": type(trainer.model_wrapped).__name__}
    trainer.accelerator.free_memory()
    return out


def accelerate_plugin(cfg: dict[str, Any], world: int, train: bool) -> dict[str, Any]:
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState(cpu=True, backend="gloo")  # as the HF Trainer sets it up for use_cpu=True
    plugin = DeepSpeedPlugin(hf_ds_config=cfg)  # the failure: "auto" it cannot fill
    out: dict[str, Any] = {"losses": [], "autos": []}
    if not train:
        return out
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model = _model()
    optimizer = DummyOptim(model.parameters(), lr=LR)
    scheduler = DummyScheduler(optimizer, total_num_steps=STEPS, warmup_num_steps=1)
    loader = torch.utils.data.DataLoader(_samples(world), batch_size=MICRO)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    batch = next(iter(loader))
    for _ in range(STEPS):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        out["losses"].append(float(loss.detach()))
    with torch.no_grad():
        out["after"] = float(model(**batch).loss)
    out["autos"] = _autos(accelerator.deepspeed_config)
    out["engine"] = type(model).__name__
    accelerator.free_memory()
    return out


def run_all(work: str, nvme: bool = True) -> dict[str, Any]:
    """Every preset through both tools, on this rank's share of the batch: this rank's
    results (the test reads rank 0's)."""
    import torch.distributed as dist

    from toolkit import runtime
    from toolkit.dsconfig.presets import DS_PRESETS, preset_configs

    runtime.prepare_deepspeed()  # CPU accelerator, gloo, no shm comm op
    world, work = dist.get_world_size(), Path(work)
    configs = preset_configs()
    results = {}
    for name in DS_PRESETS:
        preset = f"{name}_hf_trainer"
        raw = json.loads((ROOT / "ds_configs" / f"{preset}.json").read_text())
        assert raw == configs[preset], f"ds_configs/{preset}.json is stale"
        engine = nvme or "nvme" not in name
        results[preset] = {
            "hf": (hf_trainer(for_this_machine(raw, work, f"{preset}-hf"), work / preset,
                              world) if engine else None),
            "accelerate": accelerate_plugin(for_this_machine(raw, work, f"{preset}-acc"),
                                            world, train=engine),
        }
        dist.barrier()
    return results
