"""Rank functions: the live model's weights streamed out in buckets (``toolkit.adapters.stream``).

Each rank loads a tiny checkpoint of ``adapter_checks`` at the layout asked for, streams the
model twice (to rank 0, and to every rank), exports it with ``export_hf`` and compares what it
received, tensor by tensor, with that folder and with the source checkpoint. Rank 0 also hands
back its buckets and the live logits, so the test process loads the buckets into transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dist_checks import adapter_checks as ac


def _against(buckets: list, folder: Path) -> list[str]:
    """Names of streamed tensors that differ from ``folder``'s (dtype, shape or a bit)."""
    from toolkit.checkpoint.hf import HFReader

    bad = []
    with HFReader(folder) as reader:
        present = set(reader.names)
        for bucket in buckets:
            for name, tensor in bucket:
                if name not in present:
                    bad.append(f"{name} (not in the folder)")
                    continue
                want = reader.read(name, tuple((0, n) for n in reader.shape(name)))
                if tensor.dtype != want.dtype or not torch.equal(tensor, want):
                    bad.append(name)
    return bad


def _summary(buckets: list, folders: dict[str, Path]) -> dict:
    """What a rank received: per bucket its bytes and its largest tensor's, names in order,
    and the names that differ from each folder."""
    from toolkit.checkpoint.hf import HFReader

    sizes = [[t.numel() * t.element_size() for _, t in b] for b in buckets]
    out = {"count": len(buckets), "bytes": [sum(s) for s in sizes],
           "largest": [max(s, default=0) for s in sizes],
           "names": [n for b in buckets for n, _ in b]}
    for key, folder in folders.items():
        with HFReader(folder) as reader:
            out[f"{key}_names"] = sorted(reader.names)
        out[f"{key}_unequal"] = _against(buckets, folder) if buckets and buckets[0] else []
    return out


def stream_cases(root: str, families: list[str], layout: dict, bucket_bytes: int,
                 out_dir: str) -> dict:
    """For each family at ``layout``: the buckets to rank 0 and to every rank, each summarised
    against ``export_hf``'s folder and the source; a refused ``dst``."""
    from toolkit import parallel
    from toolkit.adapters import adapter_for
    from toolkit.adapters.live import (
        build_model,
        export_hf,
        fill_chunks,
        forward_logits,
        open_weights,
    )
    from toolkit.adapters.stream import StreamError, hf_buckets
    from toolkit.parallel import ParallelLayout

    rows = {}
    for family in families:
        src = Path(root) / family
        mpu = parallel.initialize(ParallelLayout(**layout))
        adapter = adapter_for(src)
        with open_weights(adapter, src) as reader:
            chunks = build_model(adapter, mpu.layout)
            fill_chunks(chunks, adapter, reader)
        to_rank0 = list(hf_buckets(chunks, adapter, bucket_bytes=bucket_bytes))
        everywhere = list(hf_buckets(chunks, adapter, bucket_bytes=bucket_bytes, dst=None))
        folder = Path(out_dir) / family
        export_hf(chunks, adapter, folder, overwrite=True)  # ends with a barrier: folder ready
        logits = forward_logits(chunks, ac.tokens(), adapter.dims.vocab)
        try:
            hf_buckets(chunks, adapter, dst=dist.get_world_size())
            refused = None
        except StreamError as err:
            refused = str(err)
        parallel.destroy()
        folders = {"export": folder, "source": src}
        row = {"to_rank0": _summary(to_rank0, folders),
               "everywhere": _summary(everywhere, folders), "refused": refused}
        if dist.get_rank() == 0:
            row.update(buckets=to_rank0, logits=logits)
        rows[family] = row
    return rows
