"""GRPO's data (``data.mode: grpo``): prompt rows, or recorded rollouts, read whole into memory.

A prompt row holds ``prompt`` (text, tokenised as TRL tokenises it: ``tokenizer(text)``; or a
list of turns, rendered by the chat template with the generation prompt) and any other columns,
which the reward functions receive by name. A recorded rollout (``grpo.rollouts``) is a JSONL row
``{"prompt", "completion_ids": [...] | "completion": text, "reward": r}``, optionally with
``"logprobs"``: the sampling engine's log-probability of each completion token (what TRL's
``rollout_func`` returns; on every row or none); consecutive rows of one prompt form a group of
``grpo.num_generations`` completions. Nothing is cached: prompts are
small and completions are made during training.

The sampler indexes completion slots (``GrpoSlots``): global batch ``k`` is optimizer step ``k``
(in order, never shuffled: the objective maps steps to generation batches and shuffles prompts
itself), so ``index // global_batch`` is the step and ``index % global_batch`` the row."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.train.data.settings import DataError, DataSettings

#: sample slots the sampler may address: far beyond any run, so indices never wrap
SLOTS = 1 << 50


@dataclass(frozen=True)
class PromptRow:
    prompt: Any  # as the row gives it (text or turns): what reward functions receive
    ids: tuple[int, ...]
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""  # file:line, for errors


@dataclass(frozen=True)
class RecordedGroup:
    """``num_generations`` recorded completions of one prompt, with their rewards."""

    prompt: PromptRow
    completion_ids: tuple[tuple[int, ...], ...]
    rewards: tuple[float, ...]
    logprobs: tuple[tuple[float, ...], ...] | None = None  # the sampler's, per completion token


class GrpoSlots:
    """The training "split" of a GRPO run: completion slots, one global batch per step
    (``rows_per_epoch``: the completions of one pass over the prompts, for ``train.epochs``)."""

    packed, reset_eod, stream = False, None, False

    def __init__(self, rows_per_epoch: int):
        self.rows_per_epoch = rows_per_epoch

    def __len__(self) -> int:
        return self.rows_per_epoch

    def sampler_args(self, shuffle: bool) -> tuple[int, bool]:
        return SLOTS, False

    def reserve(self, num_samples: int) -> None:
        """Nothing to reserve: completions are made at each generation batch."""


@dataclass
class GrpoData:
    """What the trainer reads of a GRPO run's data (``PreparedData``'s fields) plus the prompts
    and, for recorded rollouts, the groups."""

    train: GrpoSlots
    prompts: list[PromptRow]
    groups: list[RecordedGroup] | None
    key: str
    validation: None = None
    meta: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None


def encode_prompt(prompt: Any, tokenizer: Any, where: str) -> list[int]:
    """A prompt's token ids as TRL's GRPOTrainer makes them."""
    if isinstance(prompt, list):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{where}: the prompt is a list of turns but the tokenizer has no "
                            "chat template: give the prompt as text, or use a tokenizer with "
                            "one.")
        out = tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True,
                                            add_generation_prompt=True)
        return list(out["input_ids"])
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: 'prompt' must be non-empty text or a list of turns, got "
                        f"{prompt!r}.")
    return list(tokenizer(prompt)["input_ids"])


def prompt_row(row: dict[str, Any], tokenizer: Any, where: str, field_name: str = "prompt",
               drop: tuple[str, ...] = ()) -> PromptRow:
    if row.get(field_name) is None:
        keys = sorted(k for k, v in row.items() if v is not None)
        raise DataError(f"{where}: the row has no '{field_name}' (its keys: {keys}): a GRPO row "
                        f"needs '{field_name}' (text or turns); its other columns go to the "
                        "reward functions.")
    columns = {k: v for k, v in row.items() if k != field_name and k not in drop}
    return PromptRow(row[field_name], tuple(encode_prompt(row[field_name], tokenizer, where)),
                     columns, where)


def read_prompts(settings: DataSettings, tokenizer: Any) -> list[PromptRow]:
    """Every prompt row of ``data.sources``, in order."""
    from toolkit.train.data.sources import load_parts, row_location

    rows = []
    for part in load_parts(list(settings.sources)):
        for i, row in enumerate(part.rows):
            where = row_location(part.source, int(part.index[i]) if part.index is not None
                                 else i)
            rows.append(prompt_row(dict(row), tokenizer, where, settings.prompt_field))
    if not rows:
        raise DataError("data.sources hold no prompt rows.")
    return rows


def read_rollouts(path: str | Path, tokenizer: Any, group: int) -> list[RecordedGroup]:
    """The recorded rollouts of ``path``: consecutive rows of one prompt in groups of
    ``group``; a ragged group, a missing reward or a malformed line is refused by its line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"grpo.rollouts={str(path)!r}: no such file (a JSONL of recorded "
                        "rollouts: prompt, completion_ids or completion, reward).")
    from toolkit.jsonl import json_rows

    rows: list[tuple[PromptRow, tuple[int, ...], float, str]] = []
    for _, where, row in json_rows(path, DataError):
        if not isinstance(row, dict):
            raise DataError(f"{where}: a rollout row must be an object.")
        ids = _completion(row, tokenizer, where)
        rows.append((prompt_row(row, tokenizer, where, drop=("completion_ids", "completion",
                                                              "reward", "logprobs")),
                     ids, _reward(row, where), where, _logprobs(row, ids, where)))
    if not rows:
        raise DataError(f"grpo.rollouts={str(path)!r} holds no rows.")
    given = {r[4] is not None for r in rows}
    if given == {True, False}:
        where = next(r[3] for r in rows if r[4] is None)
        raise DataError(f"{where}: this row has no 'logprobs' and others have: give the "
                        "sampler's log-probabilities on every row of grpo.rollouts or on none.")
    return _groups(rows, group, path)


def _logprobs(row: dict[str, Any], ids: tuple[int, ...], where: str) -> tuple[float, ...] | None:
    lps = row.get("logprobs")
    if lps is None:
        return None
    if (not isinstance(lps, list) or len(lps) != len(ids)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps)):
        raise DataError(f"{where}: 'logprobs' must be a list of {len(ids)} numbers, one per "
                        "completion token (the sampler's log-probability of each).")
    return tuple(float(x) for x in lps)


def _completion(row: dict[str, Any], tokenizer: Any, where: str) -> tuple[int, ...]:
    ids = row.get("completion_ids")
    if ids is None and isinstance(row.get("completion"), str):
        ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0
                                                       for t in ids):
        raise DataError(f"{where}: a rollout row needs 'completion_ids' (a non-empty list of "
                        "token ids) or 'completion' (text).")
    return tuple(ids)


def _reward(row: dict[str, Any], where: str) -> float:
    r = row.get("reward")
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        raise DataError(f"{where}: a rollout row needs a numeric 'reward', got {r!r}.")
    return float(r)


def _groups(rows: list, group: int, path: Path) -> list[RecordedGroup]:
    out, i = [], 0
    while i < len(rows):
        first = rows[i][0]
        j = i
        while j < len(rows) and rows[j][0].prompt == first.prompt:
            j += 1
        if j - i != group:
            raise DataError(f"{rows[i][3]}: the group of this prompt has {j - i} rollouts, "
                            f"grpo.num_generations={group}: {path} must hold consecutive groups "
                            "of num_generations rows per prompt (ragged groups cannot be "
                            "normalised).")
        lps = tuple(r[4] for r in rows[i:j])
        out.append(RecordedGroup(first, tuple(r[1] for r in rows[i:j]),
                                 tuple(r[2] for r in rows[i:j]),
                                 None if lps[0] is None else lps))
        i = j
    return out


def prepare(settings: DataSettings, tokenizer_path: str, grpo: Any, seq_len: int) -> GrpoData:
    """The prompts (and recorded groups) of a GRPO run, read on every rank (small); a prompt
    (with its completion, or ``max_completion_length``) longer than a training row is refused by
    its location."""
    import hashlib

    from toolkit.train.data import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    if grpo.rollouts:
        groups = read_rollouts(grpo.rollouts, tokenizer, grpo.num_generations)
        prompts = [g.prompt for g in groups]
        for g in groups:
            longest = len(g.prompt.ids) + max(len(c) for c in g.completion_ids)
            if longest > seq_len + 1:
                raise DataError(f"{g.prompt.where}: prompt + completion is {longest} tokens, a "
                                f"training row holds train.seq_len + 1 = {seq_len + 1}: raise "
                                "train.seq_len or drop the row.")
    else:
        groups, prompts = None, read_prompts(settings, tokenizer)
        room = seq_len + 1 - grpo.max_completion_length
        for p in prompts:
            if len(p.ids) > room:
                raise DataError(f"{p.where}: the prompt is {len(p.ids)} tokens and leaves no "
                                f"room for grpo.max_completion_length="
                                f"{grpo.max_completion_length} in train.seq_len={seq_len} (+1): "
                                "raise train.seq_len, lower max_completion_length or shorten "
                                "the prompt.")
    key = hashlib.sha256(json.dumps([list(settings.sources), grpo.rollouts, tokenizer_path,
                                     [p.ids for p in prompts]]).encode()).hexdigest()[:20]
    return GrpoData(GrpoSlots(len(prompts) * grpo.num_generations), prompts, groups, key,
                    meta={"eos_id": tokenizer.eos_token_id, "pad_id": tokenizer.pad_token_id},
                    tokenizer=tokenizer)
