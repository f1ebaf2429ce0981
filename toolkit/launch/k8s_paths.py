"""Which files of a training config the pods can see: a pod has its image and the volumes the
manifest mounts, nothing of the machine that wrote the manifest. Checked on the config as
written (before ``bundled:`` names become this machine's paths), before anything is written.

* outputs (``output_dir``, ``checkpoint.dir``, the data cache, exports) must lie on a mounted
  persistent volume: a pod's own disk goes with the pod, and the checkpoints with it, so a
  restart would start again from step 0;
* inputs (model, tokenizer, data, a DeepSpeed JSON, a reference model, an adapter, a resume
  folder) must lie on a mounted volume too, unless they resolve inside the image: ``bundled:``
  names, and hub ids (``org/name``, ``gpt2``: no leading '/', not a file here).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from toolkit.bundled import PREFIX as BUNDLED
from toolkit.launch.k8s import K8sError, Volume

#: Keys whose values are written by the run (None: the default under output_dir).
OUTPUTS = ("output_dir", "checkpoint.dir", "data.cache_dir", "export.hf_dir",
           "export.adapter_dir")
#: Keys whose values the run reads; ``SKIP`` values are words, not paths.
INPUTS = ("model.path", "model.config", "model.tokenizer", "data.sources",
          "data.validation_sources", "deepspeed.config", "dpo.reference", "peft.adapter",
          "checkpoint.resume")
SKIP = {"deepspeed.config": {"auto"}, "checkpoint.resume": {"auto", "none"}}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _values(raw: Mapping[str, Any], key: str) -> Iterator[str]:
    node: Any = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    for value in node if isinstance(node, list) else [node]:
        if isinstance(value, str) and value not in SKIP.get(key, ()):
            yield value


def mount_of(path: str, volumes: Sequence[Volume]) -> Volume | None:
    """The volume whose mount holds ``path`` (an absolute path), if any."""
    p = PurePosixPath(path)
    for v in volumes:
        if p == PurePosixPath(v.mount) or PurePosixPath(v.mount) in p.parents:
            return v
    return None


def _hint(volumes: Sequence[Volume]) -> str:
    if not volumes:
        return "no --volume is given"
    return "mounted: " + ", ".join(f"{v.claim} at {v.mount}" for v in volumes)


def check_paths(raw: Mapping[str, Any], volumes: Sequence[Volume]) -> None:
    """Raise a K8sError naming the first key whose path a pod cannot see (or would lose)."""
    if raw.get("output_dir") is None:
        raise K8sError("output_dir is not set: the checkpoints need a folder on a persistent "
                       "volume (--volume CLAIM:MOUNT, output_dir under MOUNT)")
    for key in OUTPUTS:
        for value in _values(raw, key):
            if not value.startswith("/") or mount_of(value, volumes) is None:
                raise K8sError(
                    f"{key}={value} is not on a persistent volume ({_hint(volumes)}): a pod's "
                    "own disk is lost with the pod, and its checkpoints with it. Give "
                    "--volume CLAIM:MOUNT and an absolute path under MOUNT.")
    for key in INPUTS:
        for value in _values(raw, key):
            if value.startswith(BUNDLED) or mount_of(value, volumes) is not None:
                continue
            if not value.startswith("/") and _HUB_ID.match(value) and not Path(value).exists():
                continue  # a hub id (or preset name), resolved inside the pod
            raise K8sError(
                f"{key}={value} is not visible from the pods ({_hint(volumes)}): put it on a "
                "mounted volume and give its absolute path there, or use a bundled: name or "
                "a hub id")
