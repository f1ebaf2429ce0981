"""Generation and evaluation of a model at any layout (``mdtk generate``, ``mdtk eval``, evals
during training): megatron-core's inference machinery on the sharded model."""
