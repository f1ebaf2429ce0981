"""The one base class of the errors a user can fix: a config key, a data file, a layout, a
checkpoint, a resume. ``mdtk`` prints them as one ``error: ...`` line (once, from rank 0) and
exits non-zero without a traceback; anything else is a bug and keeps its traceback.

It sits below every other module so that each layer's own error class (``LayoutError``,
``CheckpointError``, ``DataError``, ``ConfigError``, ...) can derive from it without importing
upwards.
"""

from __future__ import annotations

import os

#: The exit status of a reported user error, on every rank (the launcher passes it on).
EXIT_STATUS = 2
#: Set (to anything but "" / "0") to show tracebacks of user errors too (``mdtk --debug``).
DEBUG_ENV = "MDTK_DEBUG"


class UserError(ValueError):
    """Something the user gave that cannot work; the message names it and says the fix."""


def debug() -> bool:
    """Whether user errors should keep their traceback (``mdtk --debug`` or MDTK_DEBUG=1)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")
