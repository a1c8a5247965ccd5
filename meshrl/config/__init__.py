"""Run configuration: schema (typed sections) and loader (YAML + dotted overrides)."""

from meshrl.config.loader import (
    ConfigError,
    build_config,
    config_from_yaml,
    config_to_yaml,
    load_config,
)
from meshrl.config.schema import RunConfig

__all__ = [
    "ConfigError",
    "RunConfig",
    "build_config",
    "config_from_yaml",
    "config_to_yaml",
    "load_config",
]
