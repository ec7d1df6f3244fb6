"""One entry of the HF <-> Megatron-Core name map, shared by the dense and MoE rule tables."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    kind: str  # "copy" | "qkv" | "qkv_bias" | "gate_up" | mla.ROPE_KINDS
    # A copy whose master lives on another pipeline stage (the tied output layer): loaded, never exported.
    replica: bool = False
