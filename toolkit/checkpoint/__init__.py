"""Checkpoint readers and writers, one module per format (hf, ...)."""
