"""HF <-> Megatron-Core name map of a sparse (mixture-of-experts) MLP layer (Qwen3-MoE, GLM-4.5, DeepSeek-V3).

Megatron names are those of the local spec with `moe_grouped_gemm=False` (a `SequentialMLP` of per-expert MLPs);
HF names are the per-expert tensors transformers 5 writes to disk (it fuses them only in memory). Rules carry
global expert numbers; with expert parallelism a rank holds experts [ep_rank * n, (ep_rank + 1) * n) as
`local_experts.0 .. n-1`, which `localize_expert` maps.
"""

from __future__ import annotations

import re

from slimish.megatron_bridge.hf_config import Architecture
from slimish.megatron_bridge.rule import Rule

# Buffers that hold weights (loaded, exported and checkpointed like parameters).
WEIGHT_BUFFERS = ("router.expert_bias",)
_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


def mlp_rules(arch: Architecture, i: int) -> list[Rule]:
    """Router, shared-expert and expert rules of decoder layer `i`, which must be sparse. The router's correction
    bias is a buffer in both worlds (HF: e_score_correction_bias, Megatron: expert_bias)."""
    m, h = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    rules = [Rule(f"{m}router.weight", (f"{h}gate.weight",), "copy")]
    if arch.moe.expert_bias:
        rules.append(Rule(f"{m}router.expert_bias", (f"{h}gate.e_score_correction_bias",), "copy"))
    if arch.moe.shared_ffn_hidden_size:
        shared_m, shared_h = f"{m}shared_experts.", f"{h}shared_experts."
        rules += [Rule(f"{shared_m}linear_fc1.weight", (f"{shared_h}gate_proj.weight", f"{shared_h}up_proj.weight"),
                       "gate_up"),
                  Rule(f"{shared_m}linear_fc2.weight", (f"{shared_h}down_proj.weight",), "copy")]
    for e in range(arch.moe.num_experts):
        expert_m, expert_h = f"{m}experts.local_experts.{e}.", f"{h}experts.{e}."
        rules += [Rule(f"{expert_m}linear_fc1.weight", (f"{expert_h}gate_proj.weight", f"{expert_h}up_proj.weight"),
                       "gate_up"),
                  Rule(f"{expert_m}linear_fc2.weight", (f"{expert_h}down_proj.weight",), "copy")]
    return rules


def is_expert(megatron_name: str) -> bool:
    """True for a parameter of one expert (sharded over expert-parallel ranks, not replicated)."""
    return _EXPERT.search(megatron_name) is not None


def localize_expert(megatron_name: str, *, first: int, count: int) -> str | None:
    """The rank-local name of a global expert parameter if this rank holds experts [first, first + count), else
    None. Names of non-expert parameters pass through unchanged."""
    match = _EXPERT.search(megatron_name)
    if match is None:
        return megatron_name
    local = int(match.group(2)) - first
    if not 0 <= local < count:
        return None
    return megatron_name[:match.start(2)] + str(local) + megatron_name[match.end(2):]


def expert_checkpoint_key(megatron_name: str) -> tuple[str, int] | None:
    """(distributed-checkpoint key, global expert index) of an expert parameter, else None: Megatron stacks a
    layer's experts under `mlp.experts.experts.*` with a leading expert axis."""
    match = _EXPERT.search(megatron_name)
    if match is None:
        return None
    return megatron_name[:match.start()] + ".mlp.experts.experts." + megatron_name[match.end():], int(match.group(2))
