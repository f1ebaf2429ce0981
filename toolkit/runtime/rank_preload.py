"""Imported once by the rank pools' fork server (``RankPool(preload=True)``): what every rank
would otherwise import for itself (torch, mdtk's CPU mode, DeepSpeed, megatron-core's GPT model,
transformers' causal LMs: ~6 s of CPU per process), in the order a spawned rank does it (the
CPU mode first, then the libraries). Ranks are forked from the server with all of it loaded.

Nothing here starts a thread or computes with torch (a fork copies one thread only: torch's
thread pool, or a lock held by another thread, would not survive it); torch runs on one thread,
as every rank does. The server is only used where CUDA is not (a process that may have touched
CUDA must not be forked).
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)

from toolkit import runtime  # noqa: E402

runtime.enable_cpu_mode()

import deepspeed  # noqa: E402,F401
from megatron.core.models.gpt import GPTModel  # noqa: E402,F401
from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: E402,F401
