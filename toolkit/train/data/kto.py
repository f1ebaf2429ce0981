"""``data.mode: kto``: unpaired feedback ``{prompt, completion, label}`` (TRL's format: ``label``
true for a desirable completion, false for an undesirable one; strings or lists of turns),
rendered as TRL's ``KTOTrainer`` renders them (the DPO rendering of one completion:
``preference.render``).

A sample is one sequence: tokens [N, seq_len+1] (prompt + completion, truncated to keep the
start), the loss mask [N, seq_len] on the completion's labels, and beside them what KTO's KL term
needs to pair a prompt with another sample's completion at batch time
(``toolkit.train.objectives.kto``): ``label`` [N], ``prompt_len`` [N], ``completion`` [N,
seq_len+1] (the completion's ids, padded) and ``completion_len`` [N]. A row whose prompt fills
``seq_len + 1`` tokens is dropped and counted (TRL drops them too). Refused, naming the row: no
``label`` or a label that is not a boolean, paired rows (``chosen``/``rejected``: that is
``data.mode: dpo``), an empty prompt. A training set of one class only is refused (KTO weighs
desirable against undesirable completions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from toolkit.train.data.preference import common_prefix, encode_parts, render
from toolkit.train.data.progress import SplitProgress
from toolkit.train.data.settings import DataError, DataSettings
from toolkit.train.data.sources import RowsPart

FIELDS = ("completion", "label")  # TRL's names (besides the prompt)


def encode_kto_row(row: dict[str, Any], tokenizer, settings: DataSettings,
                   ) -> tuple[list[int], list[int], bool]:
    """(prompt ids, completion ids, label) of one row, as TRL tokenises it."""
    keys = sorted(k for k, v in row.items() if v is not None)
    if row.get("chosen") is not None or row.get("rejected") is not None:
        raise DataError(f"a KTO row is {{prompt, completion, label}}, this one has {keys}: "
                        "preference pairs are data.mode=dpo (or split each pair into a "
                        "desirable and an undesirable row).")
    prompt, completion = row.get(settings.prompt_field), row.get("completion")
    if prompt is None or completion is None:
        missing = settings.prompt_field if prompt is None else "completion"
        raise DataError(f"the KTO row has no '{missing}' (its keys: {keys}): a KTO row needs "
                        f"'{settings.prompt_field}', 'completion' and 'label'.")
    label = row.get("label")
    if not isinstance(label, bool):
        what = "no 'label'" if label is None else f"label {label!r}"
        raise DataError(f"the KTO row has {what}: 'label' must be true (a desirable "
                        "completion) or false (an undesirable one).")
    if isinstance(prompt, list) != isinstance(completion, list):
        raise DataError(f"'{settings.prompt_field}' and 'completion' must both be strings or "
                        "both be lists of turns.")
    p, pc = render(prompt, (completion,), tokenizer, settings)
    n = common_prefix(p, pc)
    if n == 0:
        raise DataError("the prompt is empty: KTO scores completion tokens from the prompt "
                        "before them; give the row a prompt.")
    return p[:n], pc[n:], label


def pack_unpaired(rows: Sequence[tuple[Sequence[int], Sequence[int], bool]], seq_len: int,
                  pad_id: int) -> tuple[np.ndarray, np.ndarray, dict[str, int],
                                        dict[str, np.ndarray]]:
    """-> tokens [N, L+1], loss mask [N, L], stats, and the arrays the KL rows are made from."""
    width = seq_len + 1
    kept = [r for r in rows if len(r[0]) < width]
    n = len(kept)
    tokens = np.full((n, width), pad_id, dtype=np.int32)
    mask = np.zeros((n, width), dtype=np.uint8)
    completion = np.full((n, width), pad_id, dtype=np.int32)
    extra = {"label": np.zeros(n, dtype=np.uint8), "prompt_len": np.zeros(n, dtype=np.int32),
             "completion_len": np.zeros(n, dtype=np.int32)}
    for i, (p, c, label) in enumerate(kept):
        ids = (list(p) + list(c))[:width]
        tokens[i, :len(ids)] = ids
        mask[i, len(p):len(ids)] = 1
        c = list(c)[:width]
        completion[i, :len(c)] = c
        extra["label"][i], extra["prompt_len"][i], extra["completion_len"][i] = \
            label, len(p), len(c)
    stats = {"rows": len(rows), "dropped": len(rows) - n,
             "desirable": int(extra["label"].sum()),
             "truncated": sum(len(p) + len(c) > width for p, c, _ in kept)}
    return tokens, mask[:, 1:].copy(), stats, {**extra, "completion": completion}


def tokenize(parts: Sequence[RowsPart], tokenizer, settings: DataSettings, procs: int | None,
             progress: SplitProgress):
    """-> (tokens [N, L+1], loss_mask [N, L], stats, the KL arrays); sources in order."""
    def enc(row):
        p, c, label = encode_kto_row(row, tokenizer, settings)
        return {"prompt": p, "completion": c, "label": label}

    out = encode_parts(parts, enc, (settings.prompt_field, "completion"), progress, procs)
    rows = list(zip(out.get("prompt", []), out.get("completion", []), out.get("label", []),
                    strict=True))
    tokens, mask, stats, extra = pack_unpaired(rows, settings.seq_len, tokenizer.pad_token_id)
    if progress.name == "train" and len(tokens) and stats["desirable"] in (0, len(tokens)):
        kind = "desirable (label true)" if stats["desirable"] else "undesirable (label false)"
        raise DataError(f"every training row of data.mode=kto is {kind}: KTO weighs desirable "
                        "against undesirable completions; add rows of the other label.")
    return tokens, mask, stats, extra


def kl_partner(index: int, count: int, chunk: int) -> int:
    """The sample whose completion is paired with sample ``index``'s prompt for KTO's KL term:
    TRL's rotation by one inside consecutive chunks of ``chunk`` samples (its
    ``per_device_train_batch_size``; here the global batch) of the ``count`` samples:
    (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})."""
    start = index // chunk * chunk
    size = min(chunk, count - start)
    return start + (index - start - 1) % size


def kl_batch(split: Any, indices: Sequence[int] | np.ndarray, chunk: int) -> dict[str, Any]:
    """The micro-batch of KL rows of samples ``indices`` of a KTO split (``-1``: a filler, no
    loss): each sample's prompt + its partner's completion (``kl_partner``), truncated to keep
    the start, the mask on that completion's labels."""
    import torch

    idx = np.asarray(indices, dtype=np.int64)
    width = split.tokens.shape[1]
    count = len(split)
    tokens = np.zeros((len(idx), width), dtype=np.int64)  # after a row's end: never read
    mask = np.zeros((len(idx), width), dtype=np.float32)  # (causal attention, masked labels)
    for row, i in enumerate(idx):
        real = i >= 0
        i = int(i) if real else 0
        j = kl_partner(i, count, chunk)
        p = int(split.extra["prompt_len"][i])
        c = min(int(split.extra["completion_len"][j]), width - p)
        tokens[row, :p] = split.tokens[i, :p]
        tokens[row, p:p + c] = split.extra["completion"][j, :c]
        mask[row, p:p + c] = 1.0 if real else 0.0
    t = torch.from_numpy(tokens)
    seq = width - 1
    return {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(),
            "loss_mask": torch.from_numpy(mask[:, 1:].copy()),
            "position_ids": torch.arange(seq).repeat(len(idx), 1)}
