"""One seed per full tensor: the same weights at every layout.

megatron-core draws each rank's shard from that rank's RNG state, so a seed alone gives other
weights at another tp / pp / vpp / ep. Pretraining from a config (``toolkit.train.init``) and
LoRA's adapters (``toolkit.lora.attach``) instead draw every *full* tensor from its own generator,
seeded from (run seed, tensor name), and slice it for the rank."""

from __future__ import annotations

import hashlib


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (run seed, tensor name): stable across processes and Python runs."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
