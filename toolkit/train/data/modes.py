"""The data modes (``data.mode``). ``pretrain`` reads Megatron indexed datasets through
megatron-core's GPTDataset (``pretrain.prepare``); the other modes tokenise rows into fixed-length
``.npy`` samples: a module whose ``tokenize(parts, tokenizer, settings, procs, progress)``
returns (tokens [N, seq_len+1] int32, loss_mask [N, seq_len] uint8, stats[, arrays by name]),
or [N, rows, ...] for samples of several rows (``dpo``, ``reward``: a chosen and a rejected
row), and its line in ``SAMPLE_MODES``. ``distill`` reads SFT's rows (prompt/completion or
messages) with the loss on the last assistant turn (TRL's GKD: the final message is the
completion)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from toolkit.train.data.kto import tokenize as kto
from toolkit.train.data.preference import tokenize as dpo
from toolkit.train.data.progress import SplitProgress
from toolkit.train.data.reward import tokenize as reward
from toolkit.train.data.settings import DataSettings
from toolkit.train.data.sft import tokenize as sft
from toolkit.train.data.sources import RowsPart

Tokenize = Callable[..., tuple[Any, Any, dict[str, int]]]
SAMPLE_MODES: dict[str, Tokenize] = {"sft": sft, "dpo": dpo, "reward": reward, "kto": kto,
                                     "distill": functools.partial(sft, final_turn=True)}
#: the modes whose rows are SFT's (formats, templates, packing)
SFT_ROWS = ("sft", "distill")
#: ``grpo`` reads prompts (or recorded rollouts) whole: ``data.grpo``, no samples
MODES: tuple[str, ...] = ("pretrain", *SAMPLE_MODES, "grpo")


def tokenize_split(parts: Sequence[RowsPart], tokenizer, settings: DataSettings, num_proc: int,
                   name: str):
    """The samples of one split (``name``: train or validation), sources in order, under one
    progress bar."""
    procs = num_proc if num_proc > 1 else None
    with SplitProgress(name, sum(len(p) for p in parts)) as progress:
        return SAMPLE_MODES[settings.mode](parts, tokenizer, settings, procs, progress)
