"""The part every wrapping slice reader shares (``fp8.DequantizingReader``,
``mxfp4.Mxfp4Reader``, ``stacked.StackedReader``): an ``inner`` reader whose tensors the
wrapper presents under its own list of names (``_names``), the inner reader's read log, and
closing (the inner reader is closed with the wrapper)."""

from __future__ import annotations

from typing import Any


class WrappedReader:
    """Base of readers over an ``inner`` reader: ``names`` (``self._names``), ``reads``,
    ``close`` and the context manager; subclasses set ``inner``, ``path`` and ``_names``."""

    inner: Any
    path: Any
    _names: list[str]

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @property
    def reads(self) -> list:
        return self.inner.reads

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
