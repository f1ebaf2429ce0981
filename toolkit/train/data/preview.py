"""``mdtk data preview``: the training sequences as the trainer will see them, without a model.

The data is prepared exactly as the trainer prepares it (``prepare_data``: same cache, template,
truncation and packing) and read through ``TokenizedSplit.batch``, so the boundaries shown are
where the micro-batch's position ids restart (where attention and RoPE restart in the model).
Sequences are listed in the order the first optimizer steps draw them (``GlobalBatchSampler``).

In the listing, text between ``[[`` and ``]]`` carries loss (its tokens are labels the loss mask
keeps), ``||`` marks where an example (or, with ``data.reset_at_eod``, a document) starts, and
``<pad xN>`` is padding. ``summarize`` counts over the whole training split: rows read, dropped
and truncated (per SFT format), sequences, examples, tokens, loss tokens, padding fraction and
examples per sequence.

GRPO (``data.mode: grpo``) trains on completions made during the run, so its preview shows what
the generation starts from: each prompt as the model sees it (template rendered, special tokens
kept), its token count and the columns its reward functions receive; or, for recorded rollouts
(``grpo.rollouts``), each group: the prompt, every completion decoded with its reward. Prompts
are listed in file order (the trainer draws them in a seeded order with ``data.shuffle``);
recorded groups in the order the trainer takes them (the file's).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from toolkit.train.data.sampler import GlobalBatchSampler
from toolkit.train.data.settings import DataError
from toolkit.train.data.split import PreparedData, TokenizedSplit

LOSS_OPEN, LOSS_CLOSE, BOUNDARY = "[[", "]]", "||"


def summarize(data: PreparedData) -> dict[str, Any]:
    """Counts over the training split as prepared (see the module doc)."""
    split, meta = data.train, data.meta.get("train", {})
    if not isinstance(split, TokenizedSplit):  # pretraining: Megatron indexed datasets
        return _summarize_indexed(data)
    if split.rows_per_sample != 1:
        raise DataError("mdtk data preview shows sft, distill, kto and pretrain data; "
                        f"data.mode={data.meta['settings']['mode']} samples are pairs of rows.")
    n, width = split.tokens.shape
    out: dict[str, Any] = {"sequences": int(n), "seq_len": int(width - 1),
                           "loss_tokens": int(np.asarray(split.loss_mask, dtype=np.int64).sum())}
    for key in ("examples", "rows", "dropped", "truncated"):
        if key in meta:
            out["rows_read" if key in ("examples", "rows") else key] = int(meta[key])
    if "formats" in meta:
        out["formats"] = meta["formats"]
    ex = split.extra.get("examples")
    if ex is not None:
        per_row = np.diff(split.extra["row_offsets"])
        out["examples"] = int(len(ex))
        out["tokens"] = int(ex[:, 1].sum())
        out["examples_per_sequence"] = {"mean": float(per_row.mean()), "min": int(per_row.min()),
                                        "max": int(per_row.max())}
    elif "prompt_len" in split.extra:  # KTO: one row a sequence, its label beside it
        out["tokens"] = int(_kto_ends(split).sum())
        out["desirable"] = int(np.asarray(split.extra["label"]).sum())
    else:  # pretraining: every token is a document's; documents end at EOS
        out["tokens"] = int(n * width)
        eos = data.meta.get("eos_id")
        if split.reset_eod is not None and eos is not None:
            out["documents_cut_at_eos"] = int((np.asarray(split.tokens[:, :-1]) == eos).sum())
    out["padding_fraction"] = 1.0 - out["tokens"] / (n * width) if n else 0.0
    return out


def _summarize_indexed(data: PreparedData) -> dict[str, Any]:
    """Pretraining: the split's documents and tokens (``pretrain._describe``); every sample
    is full, so there is no padding."""
    meta, seq = data.meta.get("train", {}), int(data.meta["settings"]["seq_len"])
    return {"sequences": int(meta.get("samples", len(data.train))), "seq_len": seq,
            "documents": int(meta.get("documents", 0)), "tokens": int(meta.get("tokens", 0)),
            "padding_fraction": 0.0}


def _kto_ends(split) -> np.ndarray:
    """Where each KTO sequence's tokens end (prompt + completion, cut at seq_len + 1)."""
    width = split.tokens.shape[1]
    return np.minimum(np.asarray(split.extra["prompt_len"], dtype=np.int64)
                      + np.asarray(split.extra["completion_len"]), width)


def first_sequences(split, rows: int, seed: int, shuffle: bool) -> np.ndarray:
    """Indices of the first ``rows`` training sequences in the trainer's order."""
    num, shuffle = split.sampler_args(shuffle)
    rows = min(rows, len(split))
    if rows < 1:
        return np.zeros(0, dtype=np.int64)
    split.reserve(rows)
    return GlobalBatchSampler(num, rows, 1, 1, 0, seed, shuffle).global_indices(0)


def render(split, index: int, tokenizer) -> str:
    """One sequence as text: loss spans in ``[[ ]]``, example starts ``||``, padding counted."""
    batch = split.batch([index])
    tokens = np.append(batch["tokens"][0].numpy(), batch["labels"][0, -1].item())
    loss = np.append(0, batch["loss_mask"][0].numpy() > 0)  # token j is the label of j - 1
    starts = set(np.flatnonzero(batch["position_ids"][0].numpy() == 0).tolist())
    end = len(tokens)
    ex = getattr(split, "extra", {}).get("examples")
    if ex is not None:  # SFT: the padding after the last example is not an example
        mine = ex[split.extra["row_offsets"][index]:split.extra["row_offsets"][index + 1]]
        end = int(mine[-1, 0] + mine[-1, 1]) if len(mine) else 0
    label = ""
    if "prompt_len" in getattr(split, "extra", {}):  # KTO: the row's label first
        end = int(_kto_ends(split)[index])
        label = "(desirable) " if split.extra["label"][index] else "(undesirable) "
    parts: list[str] = []
    j = 0
    while j < end:
        k = j + 1
        while k < end and loss[k] == loss[j] and k not in starts:
            k += 1
        text = tokenizer.decode(tokens[j:k].tolist())
        if j in starts and j > 0:
            parts.append(BOUNDARY)
        parts.append(f"{LOSS_OPEN}{text}{LOSS_CLOSE}" if loss[j] else text)
        j = k
    if end < len(tokens):
        parts.append(f"<pad x{len(tokens) - end}>")
    return label + "".join(parts)


def format_summary(summary: dict[str, Any]) -> list[str]:
    """The summary as lines for people."""
    lines = []
    if "rows_read" in summary:
        lines.append(f"rows read {summary['rows_read']}, dropped {summary['dropped']} (no "
                     f"response token left), truncated {summary['truncated']} (longer than "
                     f"seq_len + 1 = {summary['seq_len'] + 1})")
    if "desirable" in summary:
        lines.append(f"desirable (label true) {summary['desirable']}, undesirable "
                     f"{summary['sequences'] - summary['desirable']}")
    for fmt, c in summary.get("formats", {}).items():
        lines.append(f"  {fmt}: read {c['rows']}, dropped {c['dropped']}, truncated "
                     f"{c['truncated']}")
    lines.append(f"sequences {summary['sequences']} of {summary['seq_len'] + 1} tokens"
                 + (f", examples {summary['examples']}" if "examples" in summary else ""))
    if "documents" in summary:
        lines.append(f"documents {summary['documents']}, tokens {summary['tokens']} (in the "
                     "sources' training part)")
    else:
        lines.append(f"tokens {summary['tokens']}, loss tokens {summary['loss_tokens']}, "
                     f"padding {100 * summary['padding_fraction']:.1f}%")
    if "examples_per_sequence" in summary:
        e = summary["examples_per_sequence"]
        lines.append(f"examples per sequence: mean {e['mean']:.2f}, min {e['min']}, max "
                     f"{e['max']}")
    if "documents_cut_at_eos" in summary:
        lines.append(f"EOS tokens (attention and positions restart after each): "
                     f"{summary['documents_cut_at_eos']}")
    return lines


def grpo_listing(data: Any, rows: int) -> list[str]:
    """The first ``rows`` prompts (or recorded groups) of a GRPO run's data
    (``data.grpo.GrpoData``) as lines, then a summary over all of them."""
    tok, lines = data.tokenizer, []
    if data.groups is None:
        for n, p in enumerate(data.prompts[:rows]):
            lines.append(f"--- prompt {n} ({p.where}), {len(p.ids)} tokens ---")
            lines.append(tok.decode(list(p.ids)))
            lines.append(f"reward columns: {_columns(p.columns)}")
    else:
        for n, g in enumerate(data.groups[:rows]):
            lines.append(f"--- group {n}: prompt ({g.prompt.where}), {len(g.prompt.ids)} "
                         "tokens ---")
            lines.append(tok.decode(list(g.prompt.ids)))
            for k, (ids, reward) in enumerate(zip(g.completion_ids, g.rewards, strict=True)):
                lines.append(f"  completion {k} ({len(ids)} tokens, reward {reward:g}): "
                             f"{tok.decode(list(ids))}")
    return lines + grpo_summary(data)


def _columns(columns: dict[str, Any]) -> str:
    return json.dumps(columns, ensure_ascii=False, default=str) if columns else "(none)"


def grpo_summary(data: Any) -> list[str]:
    """Counts over every prompt (and recorded completion): what a run's length limits meet."""
    lengths = np.array([len(p.ids) for p in data.prompts])
    lines = [f"--- summary ({'recorded rollouts' if data.groups else 'prompts'}) ---",
             f"prompts {len(lengths)}, prompt tokens: min {lengths.min()}, mean "
             f"{lengths.mean():.1f}, max {lengths.max()}"]
    if data.groups:
        done = np.array([len(c) for g in data.groups for c in g.completion_ids])
        rewards = np.array([r for g in data.groups for r in g.rewards])
        lines.append(f"groups {len(data.groups)} of {len(data.groups[0].completion_ids)} "
                     f"completions; completion tokens: min {done.min()}, mean "
                     f"{done.mean():.1f}, max {done.max()}")
        lines.append(f"rewards: mean {rewards.mean():.4g}, min {rewards.min():g}, max "
                     f"{rewards.max():g}")
    return lines
