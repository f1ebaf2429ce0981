"""Fused GPU kernels for the training step, from maintained libraries, chosen once per run.

Without Transformer Engine the local spec runs SwiGLU as three kernels and the loss as a
materialised fp32 logits tensor ([tokens, vocab]: 4.2 GB per 8k-token micro-batch at vocab
128k) walked several times. What mdtk can put in their place on CUDA:

- ``swiglu``: megatron-core's own fused SwiGLU / GeGLU (``bias_activation_fusion``; its
  ``jit_fuser`` compiles it with torch.compile): one read of the fc1 output, one write.
- ``cross_entropy``: megatron-core's fused vocab-parallel cross-entropy
  (``cross_entropy_loss_fusion``, the ``native`` implementation): the same maths in fewer
  passes, any tp; the logits are still materialised. bf16 runs only: megatron-core 0.16.1
  casts the logits' gradient to bf16 whatever the logits' dtype (``fused_cross_entropy.py``),
  which in an fp32 run costs precision (measured: gradients 2e-3 off, relative) and in a bf16
  run is what autograd does anyway.
- ``linear_cross_entropy``: Liger Kernel's fused linear cross-entropy: the output projection and
  the loss in vocabulary chunks, gradients computed in the forward, so the logits never exist.
  Only where the output layer is not vocab-parallel (tp = 1) and the objective is the token
  mean (SFT, pretraining): the model then returns the sum of the kept tokens' losses
  (``GPTModel`` with a ``loss_mask``), which ``toolkit.train.loop.loss.token_mean`` divides.

RMSNorm needs nothing: torch's ``rms_norm`` is one fused kernel on CUDA (``_fused_rms_norm``;
Liger's took x2.2 its time on the H200). On CPU nothing changes (the reference path). Each
kernel is checked against the unfused path on CUDA (tests/test_gpu_kernels.py) and timed
(scripts/bench_kernels.py). What ``auto`` takes follows those figures (H200, 2026-11-28, one
1B micro-batch, fwd + bwd): the fused SwiGLU is faster and smaller (x0.84 time, 0.38 vs 0.62
GiB), so ``auto`` takes it; the fused cross-entropy is faster but holds more (x0.86, 9.8 vs 5.9
GiB) and the fused linear one smaller but slower (x1.27, 1.5 vs 5.9 GiB; a whole 32k-token step
peaked at 30.1 instead of 38.5 GiB), so both are asked for by name where the trade pays.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from toolkit.errors import ConfigError

NAMES = ("swiglu", "cross_entropy", "linear_cross_entropy")
AUTO = ("swiglu",)  # what ``auto`` takes where it applies: faster and no more memory


@dataclass(frozen=True)
class Kernels:
    """Which fused kernels a run's model uses (all off: the reference path)."""

    swiglu: bool = False
    cross_entropy: bool = False
    linear_cross_entropy: bool = False

    @property
    def names(self) -> list[str]:
        return [n for n in NAMES if getattr(self, n)]

    def config_flags(self, values: dict[str, Any]) -> dict[str, Any]:
        """The TransformerConfig flags for a config built from ``values``: the fused SwiGLU
        only for the activations megatron-core fuses (gated SiLU / GeLU, no clamp or offset)."""
        import torch.nn.functional as F

        flags: dict[str, Any] = {}
        gated = values.get("gated_linear_unit", False)
        plain = (values.get("activation_func_clamp_value") is None
                 and not values.get("glu_linear_offset") and not values.get("num_moe_experts"))
        if self.swiglu and gated and plain and values.get("activation_func") in (F.silu, F.gelu):
            flags["bias_activation_fusion"] = True
        if self.cross_entropy:
            flags.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
        return flags


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def parse(setting: str) -> list[str] | None:
    """The kernels ``setting`` names (None: ``auto``, [] : ``off``); ConfigError for an
    unknown name (the config checks call this before anything is built)."""
    if setting == "auto":
        return None
    if setting == "off":
        return []
    names = [n.strip() for n in setting.split(",") if n.strip()]
    for name in names:
        if name not in NAMES:
            raise ConfigError(f"train.fused_kernels: unknown kernel {name!r}; use auto, off or "
                              f"a comma list of {', '.join(NAMES)}.")
    return names


def select(setting: str, *, cuda: bool, tp: int, token_mean: bool, bf16: bool,
           liger: bool | None = None) -> tuple[Kernels, str]:
    """The kernels for ``setting`` (``auto``: those of ``AUTO`` that apply; ``off``; or a
    comma list of ``NAMES``) and a line saying what was chosen and why not the others.
    ConfigError for an unknown name or one that cannot run here."""
    names = parse(setting)
    liger = liger_available() if liger is None else liger
    why_not = {"swiglu": None if cuda else "needs CUDA",
               "cross_entropy": "needs CUDA" if not cuda else None if bf16 else (
                   "needs bf16 (megatron-core rounds its gradient to bf16)"),
               "linear_cross_entropy": (
                   "needs CUDA" if not cuda else "needs liger-kernel (pip install liger-kernel)"
                   if not liger else f"the output layer is vocab-parallel at tp={tp}"
                   if tp > 1 else "the objective is not the token mean" if not token_mean
                   else None)}
    if names is None:
        chosen = [n for n in AUTO if why_not[n] is None]
    else:
        chosen = list(names)
        for name in chosen:
            if why_not[name] is not None:
                raise ConfigError(f"train.fused_kernels: {name} {why_not[name]}; use auto "
                                  "(it takes what applies) or drop it.")
    if "linear_cross_entropy" in chosen and "cross_entropy" in chosen:
        chosen.remove("cross_entropy")  # the fused linear loss replaces it where it applies
    kernels = Kernels(**{n: n in chosen for n in NAMES})
    skipped = [f"{n} ({why_not[n]})" for n in NAMES
               if n not in chosen and why_not[n] and (names is not None or n in AUTO)]
    return kernels, ("fused kernels: " + (", ".join(chosen) or "none")
                     + (f"; not {', '.join(skipped)}" if skipped else ""))
