"""Training: config schema, data pipeline, LR schedule, metrics and checkpoint manager.

Modules are imported directly (``toolkit.train.config``, ``toolkit.train.data``, ...) so that the
CLI can validate a config without importing torch, datasets or megatron-core.
"""
