"""Errors of the bridge that name what the user must change."""

from __future__ import annotations

from slimish.errors import UserError


class UnsupportedConfig(UserError, ValueError):
    """config.json asks for something the bridge cannot reproduce in Megatron-Core."""

    def __init__(self, field: str, value, why: str):
        super().__init__(f"config.json field '{field}'={value!r}: {why}")
        self.field = field


class MappingError(UserError, RuntimeError):
    """HF tensors and Megatron parameters do not correspond (a tensor left unmapped, a parameter left unfilled)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, truncated, corrupt or of another model; the message names the file."""
