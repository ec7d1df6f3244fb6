"""Errors of the bridge that name what the user must change."""

from __future__ import annotations


class UnsupportedConfig(ValueError):
    """config.json asks for something the bridge cannot reproduce in Megatron-Core."""

    def __init__(self, field: str, value, why: str):
        super().__init__(f"config.json field '{field}'={value!r}: {why}")
        self.field = field
