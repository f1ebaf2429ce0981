"""DPO in the trainer: the objective its loop runs (``DpoObjective``) and the reference it
needs, built from the run's config: a frozen model with the policy's layout, or the log-
probabilities of every pair computed once before the policy is built (and cached)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist

from toolkit.adapters.spec import ModelSpec
from toolkit.errors import ConfigError
from toolkit.train.objectives.base import Objective
from toolkit.train.objectives.dpo import reference as ref
from toolkit.train.objectives.dpo.loss import DpoLoss
from toolkit.train.objectives.dpo.spec import REF_FREE, architecture_difference


class DpoObjective(Objective):
    """Two rows per sample (chosen, rejected); each step's micro-batches get the reference's
    log-probabilities before the policy's schedule runs them."""

    rows_per_sample = 2

    def __init__(self, loss_fn: DpoLoss, reference: Any):
        self.loss_fn, self.reference = loss_fn, reference

    def batches(self, split_name: str, split: Any, index_lists: Sequence[np.ndarray],
                ) -> Iterator[dict[str, Any]]:
        batches = [split.batch(i) for i in index_lists]
        self.reference.attach(split_name, index_lists, batches)
        return iter(batches)

    def close(self) -> None:
        self.reference.close()


def reference_path(cfg) -> str:
    return cfg.dpo.reference or str(cfg.model.path)


def build_model_reference(cfg, layout, mpu, ds_config: dict[str, Any], policy: ModelSpec,
                          path: str | None) -> ref.ModelReference:
    """The reference checkpoint ``path`` (DPO: ``dpo.reference``) with the policy's layout and
    precision, frozen (``frozen_model``). Without one the reference is the policy's starting
    checkpoint: its model description (``policy``) and mapping serve both."""
    from toolkit.adapters import live

    model = policy if not path else ModelSpec.of(live.resolve_source(path), live=True)
    difference = architecture_difference(policy, model)
    if difference:
        raise ConfigError(f"dpo.reference={path!r} is not the policy's architecture: "
                          f"{difference} (reference vs policy).")
    return frozen_model(cfg, layout, mpu, ds_config, model)


def frozen_model(cfg, layout, mpu, ds_config: dict[str, Any], model: ModelSpec,
                 label: str = "DPO reference", dtype: Any = None) -> ref.ModelReference:
    """``model``'s chunks at the run's layout and precision (or ``dtype``), frozen
    (``frozen_chunks``)."""
    from toolkit.adapters import live
    from toolkit.train.model import DTYPES

    chunks, adapter = live.load_hf(model, layout, dtype=dtype or DTYPES[cfg.train.precision])
    return frozen_chunks(cfg, mpu, ds_config, chunks, adapter.dims.vocab, label)


def frozen_chunks(cfg, mpu, ds_config: dict[str, Any], chunks: list[Any], vocab: int,
                  label: str) -> ref.ModelReference:
    """Loaded chunks frozen, padded vocab masked; under ZeRO-3 partitioned over the
    data-parallel group like the policy, else placed like it."""
    from toolkit.train.loop.engine import mask_vocab_padding

    mask_vocab_padding(chunks, vocab)
    ref.freeze(chunks)
    engine = ref.partition(chunks, mpu, ds_config)
    return ref.ModelReference(chunks, cfg.train.seq_len, engine=engine, label=label)


def precomputed_reference(cfg, layout, mpu, ds_config: dict[str, Any], data, micro_batch: int,
                          dp_rank: int, policy: ModelSpec) -> ref.PrecomputedReference:
    """Collective, before the policy is built: the cached log-probabilities of every pair, or
    a reference model run once over the training and validation sets (then freed) and cached
    atomically beside the data (``data_cache_dir/reference_logps/KEY``)."""
    key = ref.cache_key(data.key, reference_path(cfg), cfg.train.precision)
    folder = cfg.data_cache_dir / "reference_logps" / key
    tables = ref.load_cached(folder)
    if not _everywhere(tables is not None):  # a rank that does not see the cache computes too
        model = build_model_reference(cfg, layout, mpu, ds_config, policy, cfg.dpo.reference)
        try:
            tables = ref.precompute(model, {"train": data.train, "validation": data.validation},
                                    micro_batch, layout.dp, dp_rank)
        finally:
            model.close()
        if dist.get_rank() == 0:
            ref.save_cached(folder, tables, {"reference": reference_path(cfg),
                                             "data_key": data.key,
                                             "precision": cfg.train.precision})
    return ref.PrecomputedReference(tables)


def _everywhere(flag: bool) -> bool:
    import torch

    from toolkit import runtime

    t = torch.tensor([int(flag)], device=runtime.device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def dpo_objective(cfg, layout, mpu, ds_config: dict[str, Any], policy: ModelSpec,
                  precomputed: ref.PrecomputedReference | None,
                  policy_chunks: Sequence[Any] = ()) -> Objective:
    """The run's DPO objective (ORPO, SimPO: reference-free, ``ref_free``); its reference:
    ``precomputed`` when given; with LoRA / DoRA the policy's own chunks with every adapter
    switched off (TRL's reference for a PEFT model: no second copy); else the reference model
    (built here, after the policy)."""
    d = cfg.dpo
    if d.loss in REF_FREE:
        from toolkit.train.objectives.dpo.ref_free import RefFreeLoss, RefFreeObjective

        return RefFreeObjective(RefFreeLoss(loss=d.loss, beta=d.beta, simpo_gamma=d.simpo_gamma,
                                            cpo_alpha=d.cpo_alpha))
    loss = DpoLoss(beta=d.beta, loss=d.loss, label_smoothing=d.label_smoothing)
    if precomputed is not None:
        return DpoObjective(loss, precomputed)
    return DpoObjective(loss, reference_model(cfg, layout, mpu, ds_config, policy,
                                              policy_chunks, d.reference))


def reference_model(cfg, layout, mpu, ds_config: dict[str, Any], policy: ModelSpec,
                    policy_chunks: Sequence[Any], reference: str | None,
                    ) -> ref.ModelReference:
    """A preference objective's frozen reference: with LoRA / DoRA the policy's own chunks with
    every adapter switched off (TRL's reference for a PEFT model: no second copy); else the
    reference checkpoint (``build_model_reference``), built after the policy."""
    if cfg.peft.method != "none":
        from toolkit.lora.layers import adapters_disabled

        chunks = list(policy_chunks)
        return ref.ModelReference(chunks, cfg.train.seq_len,
                                  context=lambda: adapters_disabled(chunks))
    return build_model_reference(cfg, layout, mpu, ds_config, policy, reference)
