"""Rank functions for packed sequences (tests/test_packing.py): examples kept apart at every
layout, and the token-weighted loss that makes packing invisible to it.

- ``val_losses``: the trainer's validation loss (``train.validation``) of the same rows
  packed and unpacked, per layout (the model loaded from HF at that layout, fp32).
- ``logits_vs_hf``: rows holding several examples (and padding), or documents cut at EOS,
  through the megatron-core chunks; each example's logits against transformers' logits of that
  example alone (rank 0 runs transformers).
- ``curves``: the trainer, packed and unpacked, when every global batch is the whole training
  set (the only way both hold the same examples, see docs/training.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    sp: bool = False
    micro: int = 2

    def parallel(self):
        from toolkit.parallel import ParallelLayout

        return ParallelLayout(tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp,
                              sequence_parallel=self.sp).resolve(dist.get_world_size())


def _load(model: str, layout: Layout):
    from toolkit.adapters import live

    return live.load_hf(model, layout.parallel(), dtype=torch.float32)


def val_losses(layouts: list[Layout], model: str, splits: dict[str, Any], seq_len: int,
               ) -> dict[str, dict[str, float]]:
    """{layout: {split name: validation loss}} for each prepared validation split."""
    from megatron.core import parallel_state as ps

    from toolkit import parallel
    from toolkit.train.loop.validation import validation_loss

    out = {}
    for lay in layouts:
        chunks, _ = _load(model, lay)
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        out[lay.name] = {name: validation_loss(chunks, split, micro_batch=lay.micro, dp_size=dp,
                                               dp_rank=rank, seq_len=seq_len)
                         for name, split in splits.items()}
        parallel.destroy()
    return out


def prepared(settings: dict[str, Any], tokenizer: str, cache: str, reset: bool = False):
    """The validation split of ``prepare_data`` (a cache hit: the test process prepared it)."""
    from toolkit.train.data import DataSettings, prepare_data, with_reset_at_eod

    data = prepare_data(DataSettings(**settings), tokenizer, cache)
    return with_reset_at_eod(data, reset).validation


def packed_rows(lengths: list[list[int]], seq: int, vocab: int, seed: int = 0):
    """Random tokens in rows of examples of ``lengths`` (the rest of a row: padding, its own
    segment) and their position ids; the examples as (row, start, length)."""
    from toolkit.train.data.segments import layout, packed_positions

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, vocab, (len(lengths), seq), generator=g)
    where = layout(lengths)
    pos = packed_positions(where["examples"], where["row_offsets"], np.arange(len(lengths)), seq)
    spans = [(r, int(a), int(n)) for r in range(len(lengths))
             for a, n in where["examples"][where["row_offsets"][r]:where["row_offsets"][r + 1]]]
    return tokens, torch.from_numpy(pos), spans


def logits_vs_hf(cases: list[tuple[str, Layout]], models: dict[str, str], seq: int = 48,
                 ) -> dict[str, float]:
    """{case: max relative logit difference over every example}: the examples of packed rows
    (and, for ``eod`` cases, documents cut at EOS by ``segments.eod_positions``) through mdtk
    at the layout vs transformers on each example alone. Consecutive cases of one model and
    layout share one load; transformers' model of each path is loaded once."""
    from toolkit import parallel
    from toolkit.adapters.live import forward_logits
    from toolkit.train.data.segments import eod_positions

    lengths = [[9, 17, 6, 11], [30, 13], [seq]]  # short and long examples; padding; a full row
    out: dict[str, float] = {}
    hf: dict[str, Any] = {}  # transformers' model of each path, loaded once (rank 0)
    keys = [(models[name.split(":")[0]], lay) for name, lay in cases]
    loaded: tuple = ()  # chunks and adapter, kept for the next case of one model and layout
    for i, (name, lay) in enumerate(cases):
        model = keys[i][0]
        loaded = loaded or _load(model, lay)
        chunks, adapter = loaded
        vocab = adapter.dims.vocab
        tokens, pos, spans = packed_rows(lengths, seq, vocab)
        if name.endswith(":eod"):  # EOS (id 0) ends a document; the next starts at 0
            tokens[0, [8, 25, 31]] = 0
            pos = torch.from_numpy(eod_positions(tokens.numpy(), 0))
            spans = [(0, 0, 9), (0, 9, 17), (0, 26, 6), (0, 32, seq - 32)]
        logits = forward_logits(chunks, tokens, vocab, position_ids=pos)
        if keys[i + 1:i + 2] != keys[i:i + 1]:  # the next case needs another model or layout
            loaded = ()
            parallel.destroy()
        key = f"{name}@{lay.name}"
        out[key] = _worst_vs_hf(_hf(hf, model), logits, tokens, spans) if dist.get_rank() == 0 \
            else 0.0
    return out


def _hf(cache: dict[str, Any], model: str):
    """transformers' fp32 eager model of ``model``, loaded once per ``cache``."""
    from transformers import AutoModelForCausalLM

    if model not in cache:
        cache[model] = AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, attn_implementation="eager").eval()
    return cache[model]


def _worst_vs_hf(hf: Any, logits: torch.Tensor, tokens: torch.Tensor,
                 spans: list[tuple[int, int, int]]) -> float:
    worst = 0.0
    with torch.no_grad():
        for r, a, n in spans:
            ref = hf(tokens[r:r + 1, a:a + n]).logits[0]
            got = logits[r, a:a + n]
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    return worst


def curves(case_overrides: list[tuple[str, tuple[str, ...]]], assets: dict[str, str],
           workdir: str) -> dict[str, list[float]]:
    """The trainer's per-step losses for each (name, overrides) on the SFT config of
    ``trainer_checks`` (dense model)."""
    from dist_checks import trainer_checks as tc
    from toolkit.train import trainer

    out = {}
    for name, overrides in case_overrides:
        case = tc.Case(name, mode="sft", overrides=overrides)
        result = trainer.run(tc.config(case, assets, Path(workdir) / name))
        out[name] = result.losses
    return out


def refusal(assets: dict[str, str], workdir: str, model: str, overrides: tuple[str, ...],
            ) -> str:
    """The ConfigError ``trainer.run`` raises for a packed run of ``model``."""
    from dist_checks import trainer_checks as tc
    from toolkit.train import trainer
    from toolkit.train.config import ConfigError

    case = tc.Case(f"refuse_{model}", model=model, mode="sft", steps=1, overrides=overrides)
    try:
        trainer.run(tc.config(case, assets, Path(workdir) / case.name))
    except ConfigError as e:
        return str(e)
    return ""


def two_rank_job(layouts: list[Layout], logit_cases: list[tuple[str, Layout]],
                 models: dict[str, str], data: dict[str, Any], assets: dict[str, str],
                 workdir: str) -> dict[str, Any]:
    """Everything packed that runs on 2 ranks, in one pool call."""
    splits = {k: prepared(v, assets["tokenizer"], assets["cache"]) for k, v in data.items()}
    out: dict[str, Any] = {"val": val_losses(layouts, models["dense"], splits, 64)}
    out["val_qwen3n"] = val_losses([Layout("dp2")], models["qwen3n"], splits, 64)
    out["logits"] = logits_vs_hf(logit_cases, models)
    # The same examples in every global batch, cut differently: unpacked rows at tp2 (dp1),
    # one row per micro-batch, 40 accumulation steps; packed rows at dp2, two rows per
    # micro-batch, 5 accumulation steps (packing, micro-batch, accumulation and dp all differ).
    whole = ("train.global_batch=GB", "data.validation_split=0", "data.sources=[SRC]",
             "train.seq_len=64", "train.steps=4", "data.shuffle=false", "optim.lr=3e-3")
    cases = []
    for name, gb, extra in (("curve_unpacked", assets["rows"],
                             ("data.pack=false", "parallel.tp=2", "train.micro_batch=1")),
                            ("curve_packed", assets["packs"],
                             ("data.pack=true", "parallel.tp=1", "train.micro_batch=2"))):
        cases.append((name, tuple(o.replace("GB", str(gb)).replace("SRC", assets["curve_src"])
                                  for o in whole) + extra))
    out["curves"] = curves(cases, assets, workdir)
    out["refuse_mla"] = refusal(assets, workdir, "dsv3", ("data.pack=true",))
    return out


def four_rank_job(layouts: list[Layout], model: str, data: dict[str, Any],
                  assets: dict[str, str]) -> dict[str, Any]:
    """pp4 (two middle stages) and the same rows on other layouts of 4 ranks; pretraining
    documents with reset_at_eod at pp4 and dp4."""
    splits = {k: prepared(v, assets["tokenizer"], assets["cache"], reset=k.endswith("eod"))
              for k, v in data.items()}
    return val_losses(layouts, model, splits, 64)
