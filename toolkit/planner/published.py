"""Published training throughputs with their exact layouts: what the cost model is checked on.

Each run names its source (file, table and row) and the layout the authors state. Knobs a source
does not state (micro-batch, virtual pipeline, recompute) are marked ``None`` and filled by the
planner's best choice for that layout (``toolkit.planner.calibration``); docs/planner.md lists
which runs calibrate the efficiency constants and the error on the others.

All runs are BF16 on H100 SXM-class GPUs, 8 per node, 400 Gb/s per GPU between nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.memory import ModelShape, load_model_shape
from toolkit.planner.flops import model_flops_per_token

MEGATRON_README = ("https://github.com/NVIDIA/Megatron-LM/blob/main/README.md (Training Speed "
                   "and Scalability; images/model_table.png, commit f2e5db4, 2024-07-15)")
LLM_FOUNDRY = ("https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/"
               "README.md (table 'H100 80GB BF16')")
TORCHTITAN = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
              "llama3_h100_202412_torchtitan.md (Tables 1 and 3, rows 'FSDP')")
MDTK_BENCH = "docs/benchmarks.md (Trainer, GPU: Llama-3.2-1B-sized, 8 x 4, SDPA)"


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement. ``tokens_per_s_per_gpu`` as published, or derived from the
    published model TFLOP/s per GPU with the source's own FLOP formula (Megatron-LM's equals
    ``model_flops_per_token``)."""

    name: str
    source: str
    model: ModelShape
    gpus: int
    seq_len: int
    global_batch: int
    tokens_per_s_per_gpu: float
    framework: str  # megatron-lm / fsdp / mdtk (toolkit.planner.cost.FRAMEWORKS)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 1  # the DeepSpeed stage with the same sharding (Megatron dist-opt = 1, FSDP = 3)
    micro_batch: int | None = None
    vpp: int | None = None
    recompute: str | None = None
    device: str = "h100"
    gpu_mem_gib: int = 80
    note: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)


def _megatron_gpt(name: str, hidden: int, heads: int, layers: int) -> ModelShape:
    """Megatron-LM's GPT (README: vocabulary 131,072, sequence 4096; 4h GeLU MLP, LayerNorm,
    biases and learned positions as in Megatron's GPT defaults)."""
    return ModelShape(hidden=hidden, layers=layers, heads=heads, kv_heads=heads,
                      head_dim=hidden // heads, ffn=4 * hidden, vocab=131072, tied=True,
                      qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False, norm="layer",
                      learned_positions=4096, name=name)


def _mpt(name: str, hidden: int, heads: int, layers: int, seq: int) -> ModelShape:
    """MosaicML MPT (llm-foundry yamls/pretrain/mpt-*.yaml): vocabulary 50368, 4h GeLU MLP, no
    biases, tied embeddings, learned positions (max_seq_len rows)."""
    return ModelShape(hidden=hidden, layers=layers, heads=heads, kv_heads=heads,
                      head_dim=hidden // heads, ffn=4 * hidden, vocab=50368, tied=True,
                      gated_mlp=False, norm="rms", learned_positions=seq, name=name)


def _megatron(name: str, hidden: int, heads: int, layers: int, tp: int, pp: int, gpus: int,
              batch: int, tflops: float) -> PublishedRun:
    model = _megatron_gpt(f"gpt-{name}", hidden, heads, layers)
    tokens = tflops * 1e12 / model_flops_per_token(model, 4096)
    return PublishedRun(
        f"megatron-lm {name}", f"{MEGATRON_README}, row {name}", model, gpus, 4096, batch,
        tokens, "megatron-lm", tp=tp, pp=pp, zero=1,
        note=f"published {tflops} model TFLOP/s per GPU; micro-batch, vpp and recompute not "
             "stated")


def _foundry(size: str, hidden: int, heads: int, layers: int, seq: int, gpus: int, micro: int,
             accum: int, tokens: float, ckpt: bool) -> PublishedRun:
    model = _mpt(f"mpt-{size}", hidden, heads, layers, seq)
    return PublishedRun(
        f"llm-foundry mpt-{size} s{seq} {gpus}gpu", f"{LLM_FOUNDRY}, row {size}/{seq}/{gpus}",
        model, gpus, seq, micro * accum * gpus, tokens, "fsdp", zero=3, micro_batch=micro,
        recompute="full" if ckpt else "none",
        note="FULL_SHARD, activation checkpointing " + ("on" if ckpt else "off"))


PUBLISHED: tuple[PublishedRun, ...] = (
    # Megatron-LM README, GPT weak scaling on H100 (48-way data parallel in every row)
    _megatron("1.7B", 2048, 16, 24, 1, 1, 48, 192, 408.8),
    _megatron("7.1B", 4096, 32, 30, 2, 1, 96, 192, 465.9),
    _megatron("16B", 6144, 48, 32, 4, 1, 192, 192, 489.1),
    _megatron("32B", 7168, 56, 48, 8, 1, 384, 192, 459.6),
    _megatron("70B", 8192, 64, 84, 8, 2, 768, 384, 419.7),
    _megatron("119B", 10240, 80, 92, 8, 4, 1536, 768, 420.5),
    _megatron("177B", 12288, 96, 96, 8, 6, 2304, 1152, 432.8),
    _megatron("314B", 16384, 128, 96, 8, 8, 3072, 1536, 474.4),
    _megatron("462B", 18432, 144, 112, 8, 16, 6144, 3072, 459.9),
    # llm-foundry MPT on H100 80GB, BF16, FSDP FULL_SHARD (published Throughput (T/s/GPU))
    _foundry("760m", 1536, 12, 24, 2048, 8, 24, 2, 63147, False),
    _foundry("1b", 2048, 16, 24, 2048, 64, 20, 1, 44402, False),
    _foundry("1b", 2048, 16, 24, 32768, 8, 1, 4, 12025, False),
    _foundry("3b", 2560, 20, 32, 4096, 8, 5, 6, 20964, False),
    _foundry("7b", 4096, 32, 32, 2048, 8, 6, 1, 10643, False),
    _foundry("7b", 4096, 32, 32, 4096, 8, 16, 2, 8611, True),
    _foundry("13b", 5120, 40, 40, 2048, 8, 2, 1, 4792, False),
    _foundry("13b", 5120, 40, 40, 2048, 64, 2, 1, 4800, False),
    _foundry("13b", 5120, 40, 40, 4096, 8, 10, 3, 4717, True),
    _foundry("30b", 7168, 56, 48, 2048, 32, 14, 3, 2308, True),
    _foundry("30b", 7168, 56, 48, 2048, 8, 3, 21, 2002, True),
    _foundry("70b", 8192, 64, 80, 2048, 64, 8, 4, 1039, True),
    # torchtitan, Llama 3.1 8B, FSDP (eager, no Float8), selective (per-op) checkpointing
    PublishedRun("torchtitan llama-3.1-8b 8gpu", f"{TORCHTITAN}, Table 1",
                 load_model_shape("llama-3.1-8b"), 8, 8192, 16, 5762, "fsdp", zero=3,
                 micro_batch=2, recompute="full", gpu_mem_gib=96,
                 note="H100 96GB HBM2e at 500 W (below SXM5's peak, per the source's footnote); "
                      "seq 8192 from train_configs/llama3_8b.toml; its per-op selective "
                      "checkpointing (every second matmul recomputed) is not one of mdtk's "
                      "recompute modes and is modelled as full recompute"),
    PublishedRun("torchtitan llama-3.1-8b 128gpu", f"{TORCHTITAN}, Table 3",
                 load_model_shape("llama-3.1-8b"), 128, 8192, 256, 5605, "fsdp", zero=3,
                 micro_batch=2, recompute="full", gpu_mem_gib=96,
                 note="as Table 1"),
    # mdtk's own trainer (our measurement, not a publication): 1 x H100, ZeRO-1
    PublishedRun("mdtk llama-3.2-1b 1gpu", MDTK_BENCH, load_model_shape("llama-3.2-1b"), 1, 2048,
                 32, 49879, "mdtk", zero=1, micro_batch=8, recompute="none",
                 note="random init, seq 2048, micro 8 x 4 accumulation"),
)
