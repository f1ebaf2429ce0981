"""DeepSeek-V3-shaped converter benchmark (``bench_convert.py --models deepseek-v3``).

Full DeepSeek-V3 tensor shapes (deepseek-ai/DeepSeek-V3's config.json: hidden 7168, vocab
129280, MLA with q_lora 1536 / kv_lora 512, routed experts of moe_intermediate 2048, one shared
expert, the dense MLP of 18432, e_score_correction_bias in fp32), one dense layer and one MoE
layer of ``experts`` routed experts, written tensor by tensor (the generator never holds the
model). No MTP layer (it would be a second MoE layer of the same size on disk).

Two cases, because the disk holds at most ~45 GB of benchmark data at a time (a full MoE layer is
22.5 GB in bf16, and a conversion needs its source and its output on disk at once):

- ``bf16``: HF bf16 -> mcore torch_dist at ep=8 -> HF, ``experts`` routed experts (96 by
  default: source, torch_dist and the converted HF folder of 13.8 GB each fit 45 GB), each
  conversion against ``cp -r`` of its source, alternating; the converted HF is compared
  bit-exactly with the generator's tensors (regenerated, not kept on disk). ``--experts 256``
  (a full MoE layer, 27.9 GB per folder) runs where the disk holds ~56 GB: the source is then
  deleted once converted and written again for the next round (``lean_disk``).
- ``fp8``: one full MoE layer (256 experts) as published: float8_e4m3fn linear weights with
  128 x 128 block ``weight_scale_inv`` (``toolkit.convert.fp8_quantize``), embeddings, norms,
  router and bias as stored there; FP8 HF -> bf16 mcore at ep=8 against ``cp -r`` of the FP8
  folder. The torch_dist output is read back and compared with the helper's dequantization
  (every non-expert tensor, and the first and last expert of each ep rank). The way back
  (bf16 torch_dist -> HF) is the bf16 case's direction: 2 x 28 GB would not fit the disk.

Data: a pool of 2^24 + 43 random bf16 values (seeded), tiled into each tensor from an offset
given by the tensor's name: reproducible, non-constant, and generated at memory speed.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
import zlib
from pathlib import Path
from typing import Any

import bench_measure as bc
import torch

#: deepseek-ai/DeepSeek-V3 config.json (layers and experts are set per case).
CONFIG: dict[str, Any] = dict(
    architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
    vocab_size=129280, tie_word_embeddings=False, n_group=8, topk_group=4,
    bos_token_id=0, eos_token_id=1, hidden_act="silu", attention_bias=False,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                  "type": "yarn"}, torch_dtype="bfloat16")
BLOCK = (128, 128)
_POOL_N = 2**24 + 43  # not a multiple of any row length: tiles do not line up row by row
_pools: dict[str, torch.Tensor] = {}


def config(experts: int) -> Any:
    import transformers

    return transformers.DeepseekV3Config(**CONFIG, num_hidden_layers=2, first_k_dense_replace=1,
                                         n_routed_experts=experts)


def pool(kind: str) -> torch.Tensor:
    """The seeded random pools: ``bf16`` values, and (``fp8``, ``scale``) their quantization
    by ``fp8_quantize.quantize`` (as one 2-D tensor of 128-row blocks)."""
    if not _pools:
        from toolkit.convert.fp8_quantize import quantize

        g = torch.Generator().manual_seed(0)
        _pools["bf16"] = (0.02 * torch.randn(_POOL_N, generator=g)).to(torch.bfloat16)
        rows = _POOL_N // CONFIG["hidden_size"] // BLOCK[0] * BLOCK[0]
        q, scale = quantize(_pools["bf16"][:rows * CONFIG["hidden_size"]].view(rows, -1), BLOCK)
        _pools["fp8"], _pools["scale"] = q.flatten(), scale.flatten()
    return _pools[kind]


def tiled(name: str, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """``shape`` filled with pool ``kind`` from an offset given by ``name``, wrapping around."""
    src = pool(kind)
    n, start = math.prod(shape), zlib.crc32(name.encode()) % len(src)
    out = torch.empty(n, dtype=src.dtype)
    i = 0
    while i < n:
        k = min(n - i, len(src) - start)
        out[i:i + k] = src[start:start + k]
        i, start = i + k, 0
    return out.view(shape)


def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The generator's tensor ``name``: bf16 (the bias fp32, as published), pool-tiled."""
    out = tiled(name, shape, "bf16")
    if name.endswith("e_score_correction_bias"):
        return 5 * out.float().view(shape)
    if name.endswith("norm.weight"):
        return (1.0 + 5 * out.float()).to(torch.bfloat16).view(shape)
    return out.view(shape)


def stored(name: str, shape: tuple[int, ...], fp8: bool) -> dict[str, torch.Tensor]:
    """What the checkpoint stores for ``name``: the tensor, or (FP8) weight + block scales,
    tiled from the quantized pool (quantizing 11G elements one by one would take ~15 min)."""
    from toolkit.checkpoint.fp8 import SCALE
    from toolkit.convert.fp8_quantize import quantized

    if fp8 and quantized(name, shape, torch.bfloat16):
        scales = (-(-shape[0] // BLOCK[0]), -(-shape[1] // BLOCK[1]))
        return {name: tiled(name, shape, "fp8"),
                name + SCALE: tiled(name + SCALE, scales, "scale")}
    return {name: tensor(name, shape)}


def make_checkpoint(out: Path, experts: int, fp8: bool) -> Path:
    """Write the HF folder ``out`` tensor by tensor (plan first, so shards stream)."""
    from toolkit.adapters import adapter_for
    from toolkit.checkpoint.fp8 import FP8, SCALE
    from toolkit.checkpoint.hf_writer import HFWriter
    from toolkit.convert.fp8_quantize import quantization_config, quantized

    cfg = config(experts)
    shapes = adapter_for(cfg).expected_tensors()
    plan: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for n, s in shapes.items():
        dtype = torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16
        if fp8 and quantized(n, tuple(s), dtype):
            plan[n] = (tuple(s), FP8)
            plan[n + SCALE] = ((-(-s[0] // BLOCK[0]), -(-s[1] // BLOCK[1])), torch.float32)
        else:
            plan[n] = (tuple(s), dtype)
    if fp8:
        cfg.quantization_config = quantization_config(BLOCK)
    t0 = time.perf_counter()
    writer = HFWriter(out, plan=plan, max_shard_bytes=5 * 10**9)
    for n, s in shapes.items():
        for name, t in stored(n, tuple(s), fp8).items():
            writer.add(name, t)
    writer.finish(cfg)
    print(f"built {out} ({bc.folder_bytes(out) / 2**30:.2f} GiB) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return out


def check_hf(path: Path, experts: int) -> int:
    """Every tensor of the HF folder ``path`` equals the generator's, bit for bit."""
    from toolkit.checkpoint.hf import HFReader

    with HFReader(path) as r:
        assert sorted(r.names) == sorted(_expected(experts)), "tensor names differ"
        for n in r.names:
            got = r.read(n, tuple((0, k) for k in r.shape(n)))
            want = tensor(n, tuple(r.shape(n)))
            if got.dtype != want.dtype or not torch.equal(got, want):
                raise SystemExit(f"{n} differs after the round trip")
        return len(r.names)


def check_fp8_mcore(path: Path, experts: int, ep: int) -> int:
    """The torch_dist folder ``path`` holds the helper's dequantization (bf16) of every
    non-expert tensor and of the first and last expert of each ep rank."""
    from toolkit.checkpoint import mcore_dist
    from toolkit.checkpoint.fp8 import SCALE, dequantize
    from toolkit.convert.sources import Ctx, adapter_factory

    per = experts // ep
    ends = {str(e) for r in range(ep) for e in (r * per, r * per + per - 1)}
    source, _, _ = mcore_dist.open_source(path, adapter_factory(Ctx("mcore", str(path), None,
                                                                    None, 1)))
    n = 0
    try:
        for name, shape in _expected(experts).items():
            parts = name.split(".experts.")
            if len(parts) == 2 and parts[1].split(".")[0] not in ends:
                continue
            got = source.read(name, tuple((0, k) for k in shape))
            put = stored(name, shape, True)
            want = (dequantize(put[name], put[name + SCALE], BLOCK).to(torch.bfloat16)
                    if name + SCALE in put else put[name])  # (the bias stays fp32)
            if got.dtype != want.dtype or not torch.equal(got, want):
                raise SystemExit(f"{name}: torch_dist differs from the FP8 dequantization")
            n += 1
    finally:
        source.close()
    return n


def _expected(experts: int) -> dict[str, tuple[int, ...]]:
    from toolkit.adapters import adapter_for

    return {n: tuple(s) for n, s in adapter_for(config(experts)).expected_tensors().items()}


def _timed(cmd: list[str], runs: list[dict]) -> None:
    bc.settle(False)
    runs.append(bc.measure(cmd))


def _copy(src: Path, work: Path, runs: list[dict]) -> None:
    """``cp -r`` of ``src`` (the baseline), the copy deleted right away (disk)."""
    _timed(["cp", "-r", str(src), str(work / "cp")], runs)
    shutil.rmtree(work / "cp")


def _convert(src: Path, dst: Path, to: str, ep: int, workers: str) -> list[str]:
    return [bc.MDTK, "convert", str(src), str(dst), "--to", to, "--workers", workers, "-q",
            *(["--ep", str(ep)] if to == "mcore" else [])]


def _summary(res: dict, runs: dict[str, list[dict]], pairs: tuple[tuple[str, str], ...]
             ) -> dict:
    for k, rs in runs.items():
        res[k] = {"seconds": bc.stats([r["seconds"] for r in rs]),
                  "peak_rss": max(r["peak_rss"] for r in rs)}
    for step, base in pairs:
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(runs[step], runs[base],
                                                               strict=True)]
        s = res[step]
        s["time_ratio"] = s["seconds"]["median"] / res[base]["seconds"]["median"]
        s["pair_ratios"] = bc.stats(ratios)
        s["rss_ok"] = s["peak_rss"] <= res["rss_target"]
        src, out = (("hf_bytes", "mcore_bytes") if step == "hf_to_mcore"
                    else ("mcore_bytes", "out_bytes"))
        s["gb_per_s"] = res[src] / 1e9 / s["seconds"]["median"]  # source bytes read per s
        s["out_gb_per_s"] = res[out] / 1e9 / s["seconds"]["median"]
        res[base]["gb_per_s"] = res[src] / 1e9 / res[base]["seconds"]["median"]
    return res


def bench(case: str, experts: int, ep: int, repeats: int, workers: str, root: Path) -> dict:
    """``repeats`` alternating rounds of the case (see the module docstring); everything under
    ``root`` is deleted at the end."""
    fp8 = case == "fp8"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        src = make_checkpoint(root / "hf", experts, fp8)
        largest = bc.largest_tensor_bytes(src)
        res: dict = {"model": f"deepseek-v3-{case}", "experts": experts, "ep": ep,
                     "hf_bytes": bc.folder_bytes(src), "largest_tensor": largest,
                     "rss_target": int(1.5 * 2**30 + 2 * largest), "repeats": repeats,
                     "load_before": os.getloadavg()}
        keys = ("cp_hf", "hf_to_mcore") + (() if fp8 else ("cp_mcore", "mcore_to_hf"))
        runs: dict[str, list[dict]] = {k: [] for k in keys}
        # A round needs the source, its output and one baseline copy on disk at once; where
        # the disk holds less (a full bf16 MoE layer: 3 x 28 GB), the source is deleted once
        # converted and written again for the next round (check_hf regenerates it anyway).
        lean = not fp8 and shutil.disk_usage(root).free < 2 * res["hf_bytes"] + 4 * 2**30
        res["lean_disk"] = lean
        for i in range(repeats):
            for d in ("mcore", "hf2"):
                shutil.rmtree(root / d, ignore_errors=True)
            if not src.is_dir():
                make_checkpoint(src, experts, fp8)
            _copy(src, root, runs["cp_hf"])
            _timed(_convert(src, root / "mcore", "mcore", ep, workers), runs["hf_to_mcore"])
            res["mcore_bytes"] = bc.folder_bytes(root / "mcore")
            if lean:
                shutil.rmtree(src)
            if fp8:
                res["out_bytes"] = res["mcore_bytes"]
                if i == 0:
                    res["checked_tensors"] = check_fp8_mcore(root / "mcore", experts, ep)
                continue
            _copy(root / "mcore", root, runs["cp_mcore"])
            _timed(_convert(root / "mcore", root / "hf2", "hf", ep, workers),
                   runs["mcore_to_hf"])
            res["out_bytes"] = bc.folder_bytes(root / "hf2")
            if i == 0:
                res["checked_tensors"] = check_hf(root / "hf2", experts)
        res["load_after"] = os.getloadavg()
        pairs = (("hf_to_mcore", "cp_hf"),) + (() if fp8 else (("mcore_to_hf", "cp_mcore"),))
        return _summary(res, runs, pairs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(r: dict) -> None:
    gib = 2**30
    print(f"\n{r['model']} (1 dense + 1 MoE layer of {r['experts']} experts, ep={r['ep']}, "
          f"{r['repeats']} alternating rounds, median (min, max)): HF {r['hf_bytes'] / gib:.2f} "
          f"GiB, torch_dist {r['mcore_bytes'] / gib:.2f} GiB, largest tensor "
          f"{r['largest_tensor'] / gib:.2f} GiB, RSS target {r['rss_target'] / gib:.2f} GiB")
    for k in ("cp_hf", "hf_to_mcore", "cp_mcore", "mcore_to_hf"):
        if k not in r:
            continue
        s = r[k]
        line = f"  {k:12s} {bc.fmt(s['seconds'])}  {s['gb_per_s']:.2f} GB/s of source"
        if "time_ratio" in s:
            pr = s["pair_ratios"]
            line += (f"  {s['time_ratio']:.2f}x cp -r (per round {pr['min']:.2f}-"
                     f"{pr['max']:.2f}x, spread {statistics.pstdev(pr['all']):.2f})  peak RSS "
                     f"{s['peak_rss'] / gib:.2f} GiB "
                     f"({'within' if s['rss_ok'] else 'ABOVE'} target)")
        print(line)
    print(f"  load average before {r['load_before']}, after {r['load_after']}")
    what = ("torch_dist equals the FP8 dequantization" if "fp8" in r["model"]
            else "round trip bit-exact")
    print(f"  {what}: {r['checked_tensors']} tensors", flush=True)
