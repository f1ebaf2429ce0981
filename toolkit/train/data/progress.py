"""One titled progress bar per split while tokenising, ``datasets``' own bars off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def datasets_quiet() -> Iterator[None]:
    """``datasets``' untitled progress bars off (its warnings stay on), and its JSON reader's
    error log: a file it cannot parse becomes mdtk's one error naming the line
    (``sources._bad_json``), not a second message before it."""
    import logging

    import datasets

    was_off = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    json_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_log.level
    json_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        json_log.setLevel(level)
        if not was_off:
            datasets.enable_progress_bars()


CHUNK_ROWS = 1000  # rows per datasets.map call: the bar moves at least every this many rows


class SplitProgress:
    """One titled bar per split (``tokenising train``) over the rows of all its sources
    (``datasets``' own bars, one per file load and per map, are off: ``datasets_quiet``)."""

    def __init__(self, name: str, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.bar = Progress(TextColumn(f"tokenising {name}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("rows"), transient=False)
        self.task = self.bar.add_task(name, total=total)
        self.name = name  # the split (train, validation): for messages

    def __enter__(self) -> SplitProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def map(self, rows, fn, **kwargs) -> Iterator[tuple[int, Any]]:
        """``rows.map(fn, **kwargs)`` in chunks, advancing the bar: yields (first row, result);
        ``fn`` gets the chunk's first row as ``offset`` when ``with_indices``."""
        n = len(rows)
        step = max(CHUNK_ROWS, -(-n // 20))
        for a in range(0, n, step):
            chunk = rows if step >= n else rows.select(range(a, min(a + step, n)))
            extra = {"fn_kwargs": {"offset": a}} if kwargs.get("with_indices") else {}
            yield a, chunk.map(fn, remove_columns=chunk.column_names, **extra, **kwargs)
            self.bar.advance(self.task, len(chunk))
