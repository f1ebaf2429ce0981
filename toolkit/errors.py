"""The one base class of the errors a user can fix: a config key, a data file, a layout, a
checkpoint, a resume. ``mdtk`` prints them as one ``error: ...`` line (once, from rank 0) and
exits non-zero without a traceback; anything else is a bug and keeps its traceback.

It sits below every other module so that each layer's own error class (``LayoutError``,
``CheckpointError``, ``DataError``, ...) can derive from it without importing upwards;
``ConfigError`` is shared by the trainer's config and the DeepSpeed config generator, so it
lives here.
"""

from __future__ import annotations

import os
import sys

#: The exit status of a reported user error, on every rank (the launcher passes it on).
EXIT_STATUS = 2
#: A run that saved a checkpoint and stopped on request (SIGTERM/SIGUSR1 or the stop file):
#: every rank exits with it; running the same command again resumes (sysexits' EX_TEMPFAIL).
EXIT_STOPPED = 75
#: A rank made no progress within ``runtime.heartbeat_timeout_s`` (a hung collective): the
#: watchdog ends it so the launcher restarts or fails the group instead of waiting.
EXIT_HUNG = 76
#: Set (to anything but "" / "0") to show tracebacks of user errors too (``mdtk --debug``).
DEBUG_ENV = "MDTK_DEBUG"


class UserError(ValueError):
    """Something the user gave that cannot work; the message names it and says the fix."""


class ConfigError(UserError):
    """A configuration that cannot work: a trainer YAML key, a DeepSpeed config, or a request to
    the DeepSpeed config generator that no option satisfies. The message names the key, the
    value and the fix. One class for the trainer (``toolkit.train.config``) and the generator
    (``toolkit.dsconfig``), so a caller catches one type."""


def debug() -> bool:
    """Whether user errors should keep their traceback (``mdtk --debug`` or MDTK_DEBUG=1)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def say(message: object) -> None:
    """The one way mdtk prints a user error: an ``error: ...`` line on stderr (every command and
    ``cli.main``'s handler go through it, so the format is the same everywhere)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
