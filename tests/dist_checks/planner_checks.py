"""Rank function for the planner check: run emitted trainer configs exactly as written."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def run_emitted(configs: list[str]) -> list[dict[str, Any]]:
    """``mdtk train CONFIG`` for each emitted YAML (no overrides) on the current ranks."""
    from megatron.core import parallel_state as ps

    from toolkit.train import trainer
    from toolkit.train.config import load_config

    out = []
    original = trainer.build_engine
    for path in configs:
        seen: dict[str, Any] = {}

        def spy(chunks, mpu, ds_config, seen=seen, **kw):  # the layout the run really used
            seen.update(tp=ps.get_tensor_model_parallel_world_size(),
                        pp=ps.get_pipeline_model_parallel_world_size(),
                        dp=ps.get_data_parallel_world_size(), chunks=len(chunks))
            return original(chunks, mpu, ds_config, **kw)

        trainer.build_engine = spy
        try:
            result = trainer.run(load_config(path))
        finally:
            trainer.build_engine = original
        z = result.ds_config["zero_optimization"]
        out.append({"config": path, "losses": result.losses,
                    "finite": all(math.isfinite(x) for x in result.losses),
                    "stage": z["stage"],
                    "offload": z.get("offload_optimizer", {}).get("device", "none"),
                    "metrics": (Path(load_config(path).output_dir) / "metrics.jsonl").exists(),
                    **seen})
    return out
