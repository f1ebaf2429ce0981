"""What a run optimises: a data mode's micro-batches and loss. ``base.Objective`` is
pretraining's and SFT's; ``dpo`` is preference tuning. A new objective is a module here.

Nothing is imported here: ``dpo.spec`` is torch-free (the config schema reads it), and a
package import of ``base`` would load megatron-core into every process that checks a config
(`mdtk train --check` of a missing file took 4.7 s instead of 1)."""
