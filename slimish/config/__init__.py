"""Typed job configuration: schema, YAML + dotted-override loading, validation."""

from slimish.config.errors import ConfigError
from slimish.config.loader import load_config, save_config, to_dict
from slimish.config.schema import JobConfig

__all__ = ["ConfigError", "JobConfig", "load_config", "save_config", "to_dict"]
