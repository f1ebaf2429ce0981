"""Helpers for tests that run real multi-process torch.distributed jobs."""
