"""JSON Lines read row by row, each with its location (``file:line``) for the errors that name
it; a line that is not JSON is refused by its location with ``error``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def json_rows(path: str | Path, error: type[Exception]) -> Iterator[tuple[int, str, Any]]:
    """(line number, ``file:line``, parsed row) of every non-blank line of ``path``."""
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: not JSON ({e.msg} at column {e.colno}).") from None
            yield number, where, row
