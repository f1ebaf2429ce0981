"""Rank functions for the LoRA / DoRA checks (tests/test_lora.py).

Trainer runs with adapters at many layouts against one-rank references (the same seed draws the
same adapters everywhere), PEFT's own model as the reference for exported and imported adapters,
and real DeepSpeed engines measured against the memory model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_checks import memory_checks
from dist_checks import trainer_checks as tc

LORA = ("peft.method=lora", "peft.r=4", "peft.alpha=8")
DORA = ("peft.method=dora", "peft.r=4", "peft.alpha=8")
STEPS = 3


def case(name: str, *, dora: bool = False, extra: tuple[str, ...] = (), **kw: Any) -> tc.Case:
    kw.setdefault("steps", STEPS)
    return tc.Case(name, overrides=(DORA if dora else LORA) + extra, **kw)


def run_cases(cases: list[tc.Case], assets: dict[str, str], workdir: str) -> list[dict]:
    return [tc.run_case(c, assets, workdir, on_engine=measure_engine) for c in cases]


def measure_engine(engine: Any, seen: dict[str, Any]) -> None:
    """Before the second ``engine.step`` (Adam creates its states at the first): bytes this
    rank holds for parameters, gradients and optimizer states, and its trainable parameters."""
    step = engine.step
    calls = [0]

    def measuring_step(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            seen["held_bytes"] = memory_checks.held_bytes(engine)
            seen["trainable"] = sum(int(getattr(p, "ds_numel", p.numel()))
                                    for p in engine.module.parameters() if p.requires_grad)
            seen["param_bytes"] = sum(p.numel() * p.element_size()
                                      for p in engine.module.parameters())
            seen["params"] = sum(int(getattr(p, "ds_numel", p.numel()))
                                 for p in engine.module.parameters())
        return step(*args, **kwargs)

    engine.step = measuring_step


def peft_logits_at_layout(folder: str, tp: int, pp: int) -> dict[str, float]:
    """A PEFT-made adapter (random B; DoRA: perturbed magnitudes) of each kind under ``folder``
    loaded into mdtk at tp x pp: max abs logit difference to PEFT's model, on every rank; the
    same with the adapters folded into the weights (``lora.layers.merged``: what GRPO streams
    into vLLM), and whether the weights came back bit for bit after."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from toolkit import parallel
    from toolkit.adapters import live
    from toolkit.lora.attach import attach
    from toolkit.lora.layers import merged
    from toolkit.lora.peft_io import WEIGHTS, read_config
    from toolkit.lora.state import FullTensors

    out = {}
    root = Path(folder)
    for kind in ("lora", "dora"):
        spec, _ = read_config(root / kind)
        chunks, adapter = live.load_hf(root / "base", parallel.ParallelLayout(tp=tp, pp=pp),
                                       dtype=torch.float32)
        try:
            attach(chunks, adapter, spec, live.current_coord(),
                   FullTensors(load_file(str(root / kind / WEIGHTS))),
                   tp_group=ps.get_tensor_model_parallel_group())
            ref = torch.load(root / kind / "reference.pt", weights_only=True)
            logits = live.forward_logits(chunks, ref["tokens"], adapter.dims.vocab)
            out[kind] = float((logits - ref["logits"]).abs().max())
            before = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
            with merged(chunks):
                folded = live.forward_logits(chunks, ref["tokens"], adapter.dims.vocab)
            out[f"{kind}_merged"] = float((folded - ref["logits"]).abs().max())
            out[f"{kind}_restored"] = all(torch.equal(before[n], p) for c in chunks
                                          for n, p in c.named_parameters())
        finally:
            parallel.destroy()
    return out


def make_peft_adapters(base: str, root: Path) -> str:
    """Adapters made by PEFT itself (random B, so they change the logits; DoRA with perturbed
    magnitudes) for ``base``, each with PEFT's logits on a fixed batch (in this process)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.convert.verify import fixed_tokens

    (root / "base").symlink_to(Path(base).resolve())
    for kind in ("lora", "dora"):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                     attn_implementation="eager")
        torch.manual_seed(7)
        peft = get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"],
            use_dora=kind == "dora", task_type="CAUSAL_LM"))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
                if "magnitude" in name:
                    p.mul_(1.0 + 0.1 * torch.randn_like(p))
        peft.save_pretrained(root / kind)
        tokens = fixed_tokens(model.config.vocab_size, batch=2, seq_len=16)
        peft.eval()
        with torch.no_grad():
            logits = peft(tokens).logits
        torch.save({"tokens": tokens, "logits": logits}, root / kind / "reference.pt")
    return str(root)


def four_rank_checks(folder: str, cases: list[tc.Case], assets: dict[str, str],
                     workdir: str) -> dict[str, Any]:
    return {"peft": peft_logits_at_layout(folder, 2, 2),
            "cases": run_cases(cases, assets, workdir)}


def rank0_merge_check(merged: str, base: str, adapter_dir: str) -> list[str]:
    """Tensors of mdtk's merged export that differ (bitwise) from PEFT's merge_and_unload."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if dist.get_rank() != 0:
        return []
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ref = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().state_dict()
    mine = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).state_dict()
    return [k for k in ref if not torch.equal(ref[k], mine[k])]


def two_rank_checks(cases: list[tc.Case], resume: list[tc.Case], assets: dict[str, str],
                    workdir: str, export_case: str) -> dict[str, Any]:
    """Everything on 2 ranks in one pool call: the layouts (some measured), the resumes, and
    the merged export of ``export_case`` against PEFT's ``merge_and_unload``."""
    out = {"cases": run_cases(cases, assets, workdir), "resume": run_cases(resume, assets, workdir)}
    root = Path(workdir) / export_case
    out["merge_mismatch"] = rank0_merge_check(str(root / "merged"), assets["dense"],
                                              str(root / "adapter"))
    return out
