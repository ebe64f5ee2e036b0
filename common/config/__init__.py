"""Typed job config: the schema (msgspec Structs), YAML loading with ``section.key=value`` overrides,
validation with messages that name the key, and the generated reference (docs/config.md).

- ``base.py``: ``Section`` (the Struct base), ``doc`` (field metadata) and ``ConfigError``;
- ``schema.py``: ``JobConfig`` and the model, data, rollout, broker, sync, checkpoint, telemetry and
  run sections; ``learner.py``, ``algorithm.py``, ``env.py``, ``cluster.py``: the sections of those names;
- ``overrides.py``: reading the YAML and applying ``dotted.key=value`` overrides; ``loader.py``: validating
  and printing configs; ``names.py``: TRL's / verl's names (read with a note), the defaults a job names,
  local paths made absolute in a saved config; ``docs.py``: the generated reference;
- ``preflight.py``: what a component checks on its own before loading (a local model directory).

`fleetrl config` and the job-wide checks that know components are the application's (``app/``).

Nothing here imports torch: the broker, the CLI and tests load configs without it.
"""

from fleetrl.common.config.base import ConfigError
from fleetrl.common.config.docs import config_docs
from fleetrl.common.config.loader import (
    apply_overrides,
    dump_yaml,
    load_config,
    parse_value,
    save_resolved,
    to_dict,
    validate,
)
from fleetrl.common.config.schema import JobConfig

__all__ = [
    "ConfigError",
    "JobConfig",
    "apply_overrides",
    "config_docs",
    "dump_yaml",
    "load_config",
    "parse_value",
    "save_resolved",
    "to_dict",
    "validate",
]
