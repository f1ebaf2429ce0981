"""The training config: YAML sections as small dataclasses, typed ``key.path=value`` overrides,
validation, and what the config means for a world size.

One schema serves three jobs: it types the values read from YAML and from the command line (so
``optim.lr=3e-4`` is a float even though YAML 1.1 reads it as a string), it rejects unknown keys
with a did-you-mean, and it states every allowed value in one place. Everything is checked before
any process group, model or dataset is built, so a typo costs seconds, not a queued cluster job.
A value ``bundled:REL`` names a file that ships inside mdtk (``toolkit/bundled/REL``), e.g. the
demo data ``bundled:examples/data/sft.jsonl``; it is resolved to that file's path on load.

Modules: ``typed`` (the generic dataclass/YAML/override engine), ``schema`` (the sections),
``checks`` (cross-key checks, one per section), ``load`` (YAML + overrides -> a checked
``TrainConfig``), ``runplan`` (layout and batch split for a world size).
"""

from toolkit.errors import ConfigError
from toolkit.train.config.checks import validate
from toolkit.train.config.load import apply_overrides, config_from_dict, load_config, parse_override
from toolkit.train.config.runplan import RunPlan, plan, total_steps
from toolkit.train.config.schema import (
    CheckpointSection,
    DataSection,
    DeepSpeedSection,
    DpoSection,
    ExportSection,
    LoggingSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    PeftSection,
    RuntimeSection,
    TrainConfig,
    TrainSection,
)

__all__ = [
    "CheckpointSection", "ConfigError", "DataSection", "DeepSpeedSection", "DpoSection",
    "ExportSection", "LoggingSection", "ModelSection", "OptimSection", "ParallelSection",
    "PeftSection", "RunPlan",
    "RuntimeSection", "TrainConfig", "TrainSection", "apply_overrides", "config_from_dict",
    "load_config", "parse_override", "plan", "total_steps", "validate",
]
