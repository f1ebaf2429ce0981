"""Command-line options several commands share (``mdtk estimate``, ``ds-config``, ``plan``): one
definition each, and the values they build (a cluster, a layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from toolkit.parallel.layout import ParallelLayout
from toolkit.rules import RECOMPUTE as RECOMPUTE_CHOICES

if TYPE_CHECKING:
    from toolkit.lora import LoraSpec
    from toolkit.memory import Cluster

MODEL = typer.Option(..., "--model", help="Preset name, config.json, folder or hub id.")
MODEL_OR_NONE = typer.Option(None, "--model", help="Preset name, config.json, folder or hub id.")
NODES = typer.Option(1, "--nodes", min=1)
GPUS = typer.Option(8, "--gpus-per-node", min=1)
GPU_MEM = typer.Option("80GB", "--gpu-mem", help="Memory per GPU, e.g. 80GB.")
CPU_MEM = typer.Option("1TB", "--cpu-mem", help="Host memory per node.")
TP = typer.Option(1, "--tp", min=1)
PP = typer.Option(1, "--pp", min=1)
CP = typer.Option(1, "--cp", min=1)
EP = typer.Option(1, "--ep", min=1)
VPP = typer.Option(None, "--vpp", min=1, help="Virtual pipeline stages per rank (interleaved).")
SP = typer.Option(False, "--sequence-parallel/--no-sequence-parallel")
SEQ = typer.Option(4096, "--seq-len", min=1)
MICRO = typer.Option(1, "--micro-batch", min=1)
GLOBAL = typer.Option(None, "--global-batch", min=1)
DTYPE = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32.")
RECOMPUTE = typer.Option("none", "--recompute", help=", ".join(RECOMPUTE_CHOICES) + ".")
FLASH = typer.Option(True, "--flash/--no-flash", help="Flash attention (no s^2 scores).")
AS_JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")
DPO = typer.Option(False, "--dpo", help="Preference tuning (DPO): each sample is a chosen and a "
                   "rejected sequence, and a frozen reference model (sharded like the policy) "
                   "runs forward over them (with --peft: the policy with its adapters off, no "
                   "second copy).")
PRECOMPUTE_REF = typer.Option(False, "--precompute-reference", help="With --dpo: the reference "
                              "log-probabilities are computed before training (dpo."
                              "precompute_reference), so no reference model is held.")
GRPO = typer.Option(False, "--grpo", help="Online RL (data.mode: grpo): prompt + completion "
                    "rows, and the generation engine's KV cache on every rank (the rank's rows of "
                    "the global batch at seq-len + 1).")
GRPO_REF = typer.Option(False, "--grpo-reference", help="With --grpo: grpo.beta > 0, a frozen "
                        "reference model (sharded like the policy; with --peft the policy with "
                        "its adapters off).")
GRPO_VLLM = typer.Option(None, "--grpo-vllm", min=0.0, max=1.0,
                         help="With --grpo: rollouts from vLLM colocated on every rank "
                         "(grpo.engine: vllm): this share of each GPU is vLLM's "
                         "(grpo.vllm_gpu_memory_utilization, e.g. 0.3) and mdtk's engine holds "
                         "no KV cache.")
NETWORK = typer.Option("ib", "--network", help="Inter-node network: ib (the device's own: one "
                       "400 Gb/s NDR NIC per GPU on DGX/HGX H100/H200/B200) or ethernet (one "
                       "100 GbE port per node, assumed). Decides whether ZeRO++ pays.")
ALLOW_QUANTIZED = typer.Option(False, "--allow-quantized-comm", help="Let ZeRO-3 plans on several "
                               "nodes use ZeRO++'s lossy qwZ (int8 parameter gathers) and qgZ "
                               "(int4 gradient reduction) where they pay; CUDA kernels, GPUs "
                               "only. Without it only the exact hpZ is weighed.")
PEFT = typer.Option("none", "--peft", help="none, lora or dora: train adapters only (the base "
                    "frozen in --dtype: no gradients, no optimizer states for it).")
LORA_R = typer.Option(16, "--lora-r", min=1, help="Adapter rank with --peft.")
LORA_TARGETS = typer.Option(None, "--lora-targets", help="With --peft: comma-separated HF "
                            "projection names (default: every linear layer of the blocks).")


def lora_of(peft: str, r: int, targets: str | None) -> LoraSpec | None:
    """The adapters ``--peft`` / ``--lora-r`` / ``--lora-targets`` describe (None: full)."""
    from toolkit.lora import LoraSpec

    if peft == "none":
        return None
    names = frozenset(t.strip() for t in (targets or "").split(",") if t.strip())
    return LoraSpec(method=peft, r=r, targets=names)


def cluster_of(nodes: int, gpus: int, gpu_mem: str, cpu_mem: str, nvme_path: str | None = None,
               nvme_size: str | None = None) -> Cluster:
    from toolkit.memory import Cluster, parse_bytes

    return Cluster(nodes=nodes, gpus_per_node=gpus, gpu_mem=parse_bytes(gpu_mem),
                   cpu_mem=parse_bytes(cpu_mem), nvme_path=nvme_path,
                   nvme_size=parse_bytes(nvme_size) if nvme_size else None)


def layout_of(tp: int, pp: int, cp: int, ep: int, vpp: int | None, sp: bool) -> ParallelLayout:
    return ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp, sequence_parallel=sp)
