"""Checkpoint readers and writers, one module per format, and the format registry (``formats``).

The interfaces between readers and their callers are in ``source`` (``TensorSource``,
``Opening``, ``ModelAdapter``); the files torch writes, read and written without importing
torch, in the ``torchfree`` subpackage.

``CheckpointError`` lives here, below every format module, so that readers, writers and their
users import the error without importing a reader.
"""

from toolkit.errors import UserError


class CheckpointError(UserError):
    """A checkpoint folder that cannot be used as given; the message names the file or tensor."""
