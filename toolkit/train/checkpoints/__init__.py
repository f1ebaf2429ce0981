"""A training run's checkpoints: folders and retention (``folders``), the run's record and resume
checks (``state``), the save protocol (``saver``; ``rank_save`` and ``snapshot`` for one rank's
files), and resharding a checkpoint to another layout (``reshard``, ``relayout``)."""
