"""DeepSpeed configs: generated from the memory model, linted, and written as presets."""

from toolkit.dsconfig.generator import ConfigError, Option, Plan, Request, generate
from toolkit.dsconfig.lint import HF_AUTO_KEYS, LintReport, deepspeed_errors, lint, load_config
from toolkit.dsconfig.presets import PRESET_NAMES, preset_configs, write_json

__all__ = [
    "HF_AUTO_KEYS", "PRESET_NAMES", "ConfigError", "LintReport", "Option", "Plan", "Request",
    "deepspeed_errors", "generate", "lint", "load_config", "preset_configs", "write_json",
]
