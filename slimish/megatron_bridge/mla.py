"""HF <-> Megatron-Core name map of DeepSeek multi-latent attention (MLA, DeepSeek-V3's `self_attn`).

Megatron names are those of `MLASelfAttention` built with the local layer spec (every projection a
ColumnParallelLinear, the down projections included: their outputs are gathered over TP). The layouts agree with
HF's row for row: q_b_proj / q_proj rows are per head [nope | rope], kv_a_proj_with_mqa rows are
[kv_lora_rank | rope], kv_b_proj rows are per head [k_nope | v]. The one difference is the rotary part when
HF's rope_interleave is False (`ROPE_KINDS`).
"""

from __future__ import annotations

import torch

from slimish.megatron_bridge.hf_config import Architecture
from slimish.megatron_bridge.rule import Rule

# Transformer-Engine spec names -> local-spec names: the TE MLA spec fuses the q / kv latent norms into the up
# projections (its input_layernorm stays a separate module, its pre-MLP norm is fused into linear_fc1).
TE_ALIASES = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}

# Rules whose rotary rows are reordered between HF's half-split pairs and Megatron's interleaved pairs.
Q_ROPE, KV_DOWN_ROPE = "mla_q_rope", "mla_kv_down_rope"
ROPE_KINDS = (Q_ROPE, KV_DOWN_ROPE)


def attention_rules(arch: Architecture, i: int) -> list[Rule]:
    """The self-attention rules of decoder layer `i` (the input norm included)."""
    mla = arch.mla
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn, a = f"{m}self_attention.", f"{h}self_attn."
    q_kind, kv_kind = ("copy", "copy") if mla.rope_interleave else (Q_ROPE, KV_DOWN_ROPE)
    rules = [Rule(f"{m}input_layernorm.weight", (f"{h}input_layernorm.weight",), "copy")]
    if mla.q_lora_rank is None:
        rules.append(Rule(f"{attn}linear_q_proj.weight", (f"{a}q_proj.weight",), q_kind))
    else:
        rules += [Rule(f"{attn}linear_q_down_proj.weight", (f"{a}q_a_proj.weight",), "copy"),
                  Rule(f"{attn}q_layernorm.weight", (f"{a}q_a_layernorm.weight",), "copy"),
                  Rule(f"{attn}linear_q_up_proj.weight", (f"{a}q_b_proj.weight",), q_kind)]
    return rules + [
        Rule(f"{attn}linear_kv_down_proj.weight", (f"{a}kv_a_proj_with_mqa.weight",), kv_kind),
        Rule(f"{attn}kv_layernorm.weight", (f"{a}kv_a_layernorm.weight",), "copy"),
        Rule(f"{attn}linear_kv_up_proj.weight", (f"{a}kv_b_proj.weight",), "copy"),
        Rule(f"{attn}linear_proj.weight", (f"{a}o_proj.weight",), "copy"),
    ]


def attention_linears(arch: Architecture) -> tuple[str, ...]:
    """The attention's linear modules (each has an `_extra_state` in Megatron's checkpoints), in module order."""
    q = ("linear_q_proj",) if arch.mla.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    return tuple(f"self_attention.{name}" for name in ("linear_proj", *q, "linear_kv_down_proj", "linear_kv_up_proj"))


def tp_splits(arch: Architecture) -> list[tuple[str, int]]:
    """(config.json field, size) of the MLA outputs that tensor parallelism splits, besides the heads: the local
    spec's down projections are column-parallel too."""
    splits = [("kv_lora_rank + qk_rope_head_dim", arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim)]
    if arch.mla.q_lora_rank is not None:
        splits.append(("q_lora_rank", arch.mla.q_lora_rank))
    return splits


def rope_block(rule: Rule, arch: Architecture) -> tuple[int, int]:
    """(rows per block, offset of the rotary rows in it): per head for q, once for the kv down projection."""
    mla = arch.mla
    if rule.kind == Q_ROPE:
        return mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim
    return mla.kv_lora_rank + mla.qk_rope_head_dim, mla.kv_lora_rank


def _permute_rope(rule: Rule, tensor: torch.Tensor, arch: Architecture, *, to_megatron: bool) -> torch.Tensor:
    """Reorder the rotary rows of every block: HF's non-interleaved RoPE rotates pairs (j, j + d/2), Megatron's MLA
    de-interleaves pairs (2j, 2j + 1) before rotating, so Megatron row 2j holds HF row j and 2j + 1 row j + d/2.
    Both q and k get the same permutation, which leaves every q.k product, hence the model, unchanged."""
    block, start = rope_block(rule, arch)
    d = arch.mla.qk_rope_head_dim
    tail = tensor.shape[1:]
    blocks = tensor.reshape(-1, block, *tail)
    rope = blocks[:, start:]
    if to_megatron:
        rope = rope.reshape(-1, 2, d // 2, *tail).transpose(1, 2)
    else:
        rope = rope.reshape(-1, d // 2, 2, *tail).transpose(1, 2)
    return torch.cat([blocks[:, :start], rope.reshape(-1, d, *tail)], dim=1).reshape(tensor.shape)


def to_megatron(rule: Rule, hf: list[torch.Tensor], arch: Architecture) -> torch.Tensor:
    return _permute_rope(rule, hf[0], arch, to_megatron=True)


def to_hf(rule: Rule, tensor: torch.Tensor, arch: Architecture) -> list[torch.Tensor]:
    return [_permute_rope(rule, tensor, arch, to_megatron=False)]
