"""What a run optimises: a data mode's micro-batches and loss. ``base.Objective`` is
pretraining's and SFT's; ``dpo`` is preference tuning (with the reference-free ORPO and SimPO),
``reward`` a reward model, ``kto`` unpaired feedback, ``distill`` knowledge distillation; the
trainer asks ``registry.objective_for``. A new objective is a module here and its line in
``registry.BUILDERS``.

Nothing is imported here: ``dpo.spec`` and ``spec`` are torch-free (the config schema reads
them), and a package import of ``base`` would load megatron-core into every process that checks
a config (`mdtk train --check` of a missing file took 4.7 s instead of 1)."""
