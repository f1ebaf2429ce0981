"""What a DPO config may say (torch-free: read by the config schema and checks): TRL's names of
the losses offered (the reference-free ORPO and SimPO included) and of the metrics logged, and
the cross-key checks of the ``dpo`` section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.adapters.spec import ModelSpec, has_config
from toolkit.errors import ConfigError

#: TRL ``loss_type`` names whose value for a pair depends on that pair alone (so the loss of a
#: global batch does not depend on how it is split): see ``losses``.
LOSSES = ("sigmoid", "hinge", "ipo", "sigmoid_norm", "robust", "exo_pair", "bco_pair",
          "nca_pair", "sppo_hard", "apo_zero", "apo_down")
#: reference-free losses on the same pairs (TRL's ORPOTrainer, CPOTrainer's ``simpo``):
#: ``ref_free``; no reference model is built
REF_FREE = ("orpo", "simpo")
SMOOTHED = ("robust", "exo_pair")  # the losses that read label_smoothing
#: TRL's metric names (training; validation logs them with the ``val_`` prefix)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


def check_settings(mode: str, dpo: Any, defaults: Any) -> None:
    """The ``dpo`` section against ``data.mode`` and itself."""
    if mode != "dpo":
        changed = [k for k in vars(defaults) if getattr(dpo, k) != getattr(defaults, k)]
        if changed:
            raise ConfigError(f"dpo.{changed[0]} applies to data.mode=dpo (preference pairs); "
                              f"got data.mode={mode}: remove it or set data.mode=dpo.")
        return
    if dpo.beta <= 0:
        raise ConfigError(f"dpo.beta={dpo.beta} must be > 0 (TRL's default is 0.1).")
    _check_ref_free(dpo, defaults)
    ls = dpo.label_smoothing
    if dpo.loss not in SMOOTHED and ls:
        raise ConfigError(f"dpo.label_smoothing={ls} is read only by the losses "
                          f"{', '.join(SMOOTHED)}; dpo.loss={dpo.loss} ignores it: remove it.")
    if dpo.loss == "robust" and not ls < 0.5:
        raise ConfigError(f"dpo.label_smoothing={ls}: the robust loss needs it in [0, 0.5) (the "
                          "probability that a preference label is flipped; 0.1 is typical).")
    if dpo.loss == "exo_pair" and not 0 < ls < 1:
        raise ConfigError(f"dpo.label_smoothing={ls}: the exo_pair loss needs it in (0, 1) "
                          "(the EXO paper recommends 1e-3).")


def _check_ref_free(dpo: Any, defaults: Any) -> None:
    """ORPO and SimPO need no reference; SimPO's settings are read by SimPO only."""
    if dpo.loss in REF_FREE:
        if dpo.reference is not None or dpo.precompute_reference:
            key = "reference" if dpo.reference is not None else "precompute_reference"
            raise ConfigError(f"dpo.{key} with dpo.loss={dpo.loss}: {dpo.loss} is reference-free "
                              "(no reference model is used): remove it.")
    for key in ("simpo_gamma", "cpo_alpha"):
        if dpo.loss != "simpo" and getattr(dpo, key) != getattr(defaults, key):
            raise ConfigError(f"dpo.{key} is read by dpo.loss=simpo only (TRL's CPOConfig); "
                              f"dpo.loss={dpo.loss} ignores it: remove it.")
    if dpo.loss == "simpo" and dpo.cpo_alpha < 0:
        raise ConfigError(f"dpo.cpo_alpha={dpo.cpo_alpha} must be >= 0 (the weight of the NLL "
                          "term; 0 is the SimPO paper, TRL's default is 1.0).")


def _local(path: str) -> ModelSpec | None:
    """The model of a local HF folder (None: not one)."""
    return ModelSpec.of(Path(path)) if has_config(path) else None


def check_reference(policy: str | None, reference: str | None) -> None:
    """A reference checkpoint must exist and have the policy's architecture and vocabulary
    (compared on config.json when both are local folders; hub ids are checked on load)."""
    if reference is None:
        return
    ref = _local(reference)
    if ref is None:
        if Path(reference).exists() or reference.startswith((".", "/", "~")) or \
                reference.count("/") != 1:
            raise ConfigError(f"dpo.reference={reference!r}: no HF folder with a config.json "
                              "there (give the reference model's folder or hub id, or leave "
                              "dpo.reference unset to use the starting model).")
        return
    mine = _local(policy) if policy else None
    if mine is not None:
        difference = architecture_difference(mine, ref)
        if difference:
            raise ConfigError(
                f"dpo.reference={reference!r} is not the policy's architecture: {difference} "
                f"(reference vs model.path={policy!r}). The reference must be the same model "
                "family and size with the same vocabulary (usually the checkpoint the policy "
                "starts from).")


def architecture_difference(policy: ModelSpec, reference: ModelSpec) -> str | None:
    """What differs between two models as their family describes them (type, sizes,
    vocabulary, tying), or None."""
    import dataclasses

    from toolkit.memory.model import shape_of

    mine, theirs = policy.config.get("model_type"), reference.config.get("model_type")
    if mine != theirs:
        return f"model_type {theirs!r} vs {mine!r}"
    a, b = (dataclasses.asdict(shape_of(m)) for m in (reference, policy))
    for key in a:
        if key != "name" and a[key] != b[key]:
            return f"{key} {a[key]!r} vs {b[key]!r}"
    return None
