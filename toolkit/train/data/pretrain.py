"""``data.mode: pretrain``: each document tokenised (the tokenizer's BOS convention), EOS
appended, all documents concatenated and cut into blocks of ``seq_len + 1`` that overlap by one
token (every token is a label once); the tail shorter than a block is dropped. Loss mask all
ones."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from toolkit.train.data.packing import pack_pretrain
from toolkit.train.data.progress import SplitProgress
from toolkit.train.data.settings import DataError, DataSettings
from toolkit.train.data.sources import RowsPart, source_name


def tokenize(parts: Sequence[RowsPart], tokenizer, settings: DataSettings, procs: int | None,
             progress: SplitProgress):
    """-> (tokens [N, L+1] int32, loss_mask [N, L] uint8, stats); sources in order."""
    L, eos = settings.seq_len, tokenizer.eos_token_id

    def tok(batch):
        ids = tokenizer(batch[settings.text_field], add_special_tokens=True)["input_ids"]
        return {"ids": [list(x) + [eos] if not x or x[-1] != eos else list(x) for x in ids]}

    docs: list[list[int]] = []
    for part in parts:
        if settings.text_field not in part.rows.column_names:
            raise DataError(f"pretrain data {source_name(part.source)} has no "
                            f"'{settings.text_field}' column (columns: "
                            f"{part.rows.column_names}); set data.text_field.")
        for _, out in progress.map(part.rows, tok, batched=True, num_proc=procs):
            docs += out["ids"]
    tokens = pack_pretrain(docs, L)
    stats = {"documents": len(docs), "tokens": int(sum(len(d) for d in docs))}
    return tokens, np.ones((len(tokens), L), dtype=np.uint8), stats
