"""The converter's progress bar: bytes written, speed and time left (rich, imported on use)."""

from __future__ import annotations

from typing import Any


class Progress:
    """A rich progress bar with bytes, speed and ETA (silent when ``enabled`` is False)."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled, total, label
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                     DownloadColumn(), TransferSpeedColumn(),
                                     TimeRemainingColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total)
        return self

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, nbytes)

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
