"""``data.mode: sft``: each row read in its format (``sft_formats``) and encoded with a loss mask
on the response tokens, then truncated, padded or packed into rows of ``seq_len + 1``
(``packing.pack_sft``: bin-packed, each example's boundaries recorded, so the model keeps the
examples of a row apart). A row that cannot be read is reported with its file and line."""

from __future__ import annotations

from collections.abc import Sequence

from toolkit.train.data.packing import pack_sft
from toolkit.train.data.progress import SplitProgress
from toolkit.train.data.settings import DataError, DataSettings
from toolkit.train.data.sft_formats import detect_format, encode_sft_row
from toolkit.train.data.sources import RowsPart, row_location


def last_turn(mask: Sequence[int]) -> list[int]:
    """``mask`` with only its last run of ones kept: a conversation's final assistant turn
    (distillation scores the completion of the last turn, as TRL's GKD collator does)."""
    out = [0] * len(mask)
    end = max((i for i, m in enumerate(mask) if m), default=-1)
    i = end
    while i >= 0 and mask[i]:
        out[i] = 1
        i -= 1
    return out


def tokenize(parts: Sequence[RowsPart], tokenizer, settings: DataSettings, procs: int | None,
             progress: SplitProgress, *, final_turn: bool = False):
    """-> (tokens [N, L+1] int32, loss_mask [N, L] uint8, stats, where the examples sit);
    sources in order. ``final_turn``: the loss on each row's last assistant turn only."""
    examples: list[tuple[list[int], list[int]]] = []
    formats: list[str] = []
    for part in parts:
        source, index = part.source, part.index

        def enc(row, i, offset, source=source, index=index):
            try:
                ids, mask = encode_sft_row(row, tokenizer, settings)
                mask = last_turn(mask) if final_turn else mask
                fmt = detect_format(row, settings)
            except DataError as e:
                at = row_location(source, int(index[offset + i]) if index is not None
                                  else offset + i)
                raise DataError(f"{at}: {e}") from None
            return {"ids": ids, "mask": mask, "format": fmt}

        for _, out in progress.map(part.rows, enc, with_indices=True, num_proc=procs):
            examples += zip(out["ids"], out["mask"], strict=True)
            formats += out["format"]
    return pack_sft(examples, settings.seq_len, tokenizer.pad_token_id, settings.pack,
                    seed=settings.seed, formats=formats)
