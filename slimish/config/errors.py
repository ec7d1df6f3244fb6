"""`ConfigError`: the one error every config check raises (loading, overrides, cross-field validation).

It lives in a module of its own, importing nothing of slimish.config, so that the loader, the validator and any
other layer that refuses a config value (checkpoints, weight-sync transports) can all raise it without importing
each other: loader.py imports validate.py, and validate.py needs only this error.
"""

from __future__ import annotations

from slimish.errors import UserError


class ConfigError(UserError, ValueError):
    """An invalid configuration; `key` is the dotted path of the offending entry."""

    def __init__(self, key: str, message: str):
        super().__init__(f"config key '{key}': {message}")
        self.key = key
