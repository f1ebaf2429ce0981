"""Preference tuning (DPO), as TRL's ``DPOTrainer`` computes it, at every layout of the trainer.

``spec`` (torch-free: loss names, metric names, the config checks), ``losses`` (one per-pair
formula per TRL loss name), ``loss`` (the engine's loss function: per-sequence log-probabilities
of a micro-batch, the loss, TRL's metrics), ``reference`` (where the reference log-probabilities
come from: a frozen model with the policy's layout, or a cache computed once before training)
and ``objective`` (what the trainer's loop asks of a data mode: its micro-batches and loss).
The data side is ``toolkit.train.data.preference`` (``data.mode: dpo``).
"""
