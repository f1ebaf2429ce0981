"""Checkpoint readers and writers, one module per format, and the format registry (``formats``).

``CheckpointError`` lives here, below every format module, so that readers, writers and their
users import the error without importing a reader.
"""

from toolkit.errors import UserError


class CheckpointError(UserError):
    """A checkpoint folder that cannot be used as given; the message names the file or tensor."""
