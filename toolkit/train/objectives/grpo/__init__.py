"""Online RL from verifiable rewards (``data.mode: grpo``): the GRPO family as TRL's
GRPOTrainer computes it (``loss``), rewards and advantages (``rewards``), rollouts recorded or
generated on the training ranks (``rollouts``), the objective the loop runs (``objective``) and
what the config checks read (``spec``, torch-free)."""
