"""HF <-> Megatron-Core name and shape map of the decoder families (Llama-3, Qwen2/2.5, Qwen3; the sparse MLP
layers of Qwen3-MoE come from `moe`, DeepSeek-V3's multi-latent attention from `mla`).

This table is the single source of truth for both checkpoint conversion and weight sync. Megatron names are those
of `GPTModel` built with the local layer spec; the Transformer-Engine spec fuses the two pre-norms into the next
linear layer, which `TE_ALIASES` maps back.
"""

from __future__ import annotations

import torch

from slimish.megatron_bridge import mla, moe
from slimish.megatron_bridge.hf_config import Architecture
from slimish.megatron_bridge.rule import Rule

TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def layer_rules(arch: Architecture, i: int) -> list[Rule]:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    rules = _attention_rules(arch, i) + [
        Rule(f"{m}pre_mlp_layernorm.weight", (f"{h}post_attention_layernorm.weight",), "copy")]
    if arch.moe is not None and arch.moe.is_sparse(i):
        return rules + moe.mlp_rules(arch, i)
    return rules + [
        Rule(f"{m}mlp.linear_fc1.weight", (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"), "gate_up"),
        Rule(f"{m}mlp.linear_fc2.weight", (f"{h}mlp.down_proj.weight",), "copy"),
    ]


def _attention_rules(arch: Architecture, i: int) -> list[Rule]:
    """The input norm and self-attention of decoder layer `i`."""
    if arch.mla is not None:
        return mla.attention_rules(arch, i)
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn = f"{h}self_attn."
    rules = [
        Rule(f"{m}input_layernorm.weight", (f"{h}input_layernorm.weight",), "copy"),
        Rule(f"{m}self_attention.linear_qkv.weight",
             (f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"), "qkv"),
    ]
    if arch.add_qkv_bias:
        rules.append(Rule(f"{m}self_attention.linear_qkv.bias",
                          (f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias"), "qkv_bias"))
    if arch.qk_layernorm:
        rules += [Rule(f"{m}self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), "copy"),
                  Rule(f"{m}self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), "copy")]
    return rules + [Rule(f"{m}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), "copy")]


def is_mtp_tensor(hf_name: str, arch: Architecture) -> bool:
    """True for a tensor of a multi-token-prediction layer (model.layers.{num_layers + k}.*, DeepSeek's
    num_nextn_predict_layers). The bridge skips these on purpose: the model is built and trained without MTP, and
    exported / converted checkpoints do not contain them (SGLang then serves without MTP speculative decoding)."""
    if not hf_name.startswith("model.layers."):
        return False
    index = hf_name.split(".")[2]
    return index.isdigit() and arch.num_layers <= int(index) < arch.num_layers + arch.mtp_layers


def unmapped_hf_names(names, arch: Architecture) -> list[str]:
    """HF tensor names no rule maps (MTP layers excepted): loading them would silently drop them."""
    mapped = {n for r in model_rules(arch) for n in r.hf}
    return sorted(n for n in names if n not in mapped and not is_mtp_tensor(n, arch))


def model_rules(arch: Architecture) -> list[Rule]:
    """Every parameter of the model, in HF checkpoint order."""
    return stage_rules(arch, layers=range(arch.num_layers), first=True, last=True)


def stage_rules(arch: Architecture, *, layers: range, first: bool, last: bool) -> list[Rule]:
    """The parameters of the pipeline stage holding global decoder `layers` (and the embedding / head when it is the
    first / last stage), with global layer numbers, in HF checkpoint order."""
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy")] if first else []
    for i in layers:
        rules += layer_rules(arch, i)
    if last:
        rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
        if not arch.tie_word_embeddings:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",), "copy"))
        elif not first:
            # Megatron keeps its own copy of the tied matrix on the last stage and all-reduces its grads with the
            # first stage's embedding, so both stay equal; the first stage exports it.
            rules.append(Rule("output_layer.weight", ("model.embed_tokens.weight",), "copy", replica=True))
    return rules


_LAYER_PREFIX = "decoder.layers."


def _te_name(rest: str) -> str:
    for te_suffix, local_suffix in TE_ALIASES.items():
        if rest == local_suffix:
            return te_suffix
    return rest


def checkpoint_key(megatron_name: str, arch: Architecture) -> tuple[str, int | None, int]:
    """(key in a Megatron-Core distributed checkpoint, index along the key's stacked leading axis or None, length of
    that axis) of a global Megatron name.

    Megatron names the two pre-norms as the Transformer-Engine spec does, so checkpoints load with either layer
    spec (except with MLA: its local spec keeps the local names). When every layer has the same structure it stacks
    each layer's tensor under one key with a leading layer axis; for a mixture-of-experts model (built with a
    per-layer moe_layer_freq list) it keys each layer on its own and stacks a layer's experts instead.
    """
    if not megatron_name.startswith(_LAYER_PREFIX):
        return megatron_name, None, 0
    index, rest = megatron_name[len(_LAYER_PREFIX):].split(".", 1)
    # Megatron's local MLA spec has no TE-style keys map: its norms keep their module names in checkpoints.
    rest = rest if arch.mla is not None else _te_name(rest)
    if arch.moe is None:
        return _LAYER_PREFIX + rest, int(index), arch.num_layers
    expert = moe.expert_checkpoint_key(megatron_name)
    if expert is not None:
        return *expert, arch.moe.num_experts
    return f"{_LAYER_PREFIX}{index}.{rest}", None, 0


_MLP_LINEARS = ("mlp.linear_fc1", "mlp.linear_fc2")


def _attention_linears(arch: Architecture) -> tuple[str, ...]:
    if arch.mla is not None:
        return mla.attention_linears(arch)
    return "self_attention.linear_qkv", "self_attention.linear_proj"


def extra_state_objects(arch: Architecture) -> list[str]:
    """Names of the `_extra_state` objects (None with the local spec) that Megatron's layer checkpoints carry, in
    its ShardedObject naming: key/shard_{offset}_{count}."""
    attention = _attention_linears(arch)
    if arch.moe is None:
        return [f"{_LAYER_PREFIX}{m}._extra_state/shard_{i}_{arch.num_layers}"
                for m in attention + _MLP_LINEARS for i in range(arch.num_layers)]
    names = []
    for i in range(arch.num_layers):
        if arch.moe.is_sparse(i):
            names += [f"{_LAYER_PREFIX}{i}.{m}._extra_state/shard_0_1" for m in attention]
            if arch.moe.shared_ffn_hidden_size:
                names += [f"{_LAYER_PREFIX}{i}.mlp.shared_experts.linear_fc{n}._extra_state/shard_0_1" for n in (1, 2)]
            names += [f"{_LAYER_PREFIX}{i}.mlp.experts.experts.linear_fc{n}._extra_state/shard_{e}_"
                      f"{arch.moe.num_experts}" for n in (1, 2) for e in range(arch.moe.num_experts)]
        else:
            names += [f"{_LAYER_PREFIX}{i}.{m}._extra_state/shard_0_1" for m in attention + _MLP_LINEARS]
    return names


def canonical_megatron_name(name: str) -> str:
    """Strip DDP/Float16 wrappers ('module.') and map Transformer-Engine fused-norm names to local-spec names."""
    while name.startswith("module."):
        name = name[len("module."):]
    for te_suffix, local_suffix in (*TE_ALIASES.items(), *mla.TE_ALIASES.items()):
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


def _qkv_groups(arch: Architecture) -> tuple[int, int, int]:
    groups = arch.num_query_groups
    return groups, arch.num_attention_heads // groups * arch.kv_channels, arch.kv_channels


def megatron_shape(rule: Rule, hf_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of the full Megatron tensor: every kind stacks its HF tensors' rows (qkv interleaves them by group)."""
    return (sum(shape[0] for shape in hf_shapes), *hf_shapes[0][1:])


def stacks_in_order(rule: Rule) -> bool:
    """True when the Megatron tensor is the HF tensors concatenated along dim 0 in rule order, so a converter can
    read them straight into one buffer."""
    return rule.kind in ("copy", "gate_up")


def to_megatron(rule: Rule, hf: list[torch.Tensor], arch: Architecture) -> torch.Tensor:
    """Full (unsharded) Megatron tensor from the rule's HF tensors."""
    if rule.kind == "copy":
        return hf[0]
    if rule.kind == "gate_up":
        return torch.cat(hf, dim=0)
    if rule.kind in mla.ROPE_KINDS:
        return mla.to_megatron(rule, hf, arch)
    return fuse_qkv(hf, arch)


def qkv_widths(arch: Architecture) -> tuple[int, int, int]:
    """(query groups, q rows per group, k (= v) rows per group) of the fused q/k/v tensor."""
    return _qkv_groups(arch)


def fuse_qkv(hf: list[torch.Tensor], arch: Architecture, *, groups: int | None = None) -> torch.Tensor:
    """Megatron's fused q/k/v rows, interleaved by query group, from q, k and v holding `groups` consecutive groups
    (default: all of them; a tensor-parallel rank's slice holds groups / TP)."""
    all_groups, q_width, kv_width = _qkv_groups(arch)
    groups = all_groups if groups is None else groups
    q, k, v = hf
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    fused = torch.cat([q.reshape(groups, q_width, *tail), k.reshape(groups, kv_width, *tail),
                       v.reshape(groups, kv_width, *tail)], dim=1)
    return fused.reshape(-1, *tail)


def to_hf(rule: Rule, tensor: torch.Tensor, arch: Architecture) -> list[torch.Tensor]:
    """The rule's HF tensors from a full Megatron tensor (views where possible)."""
    if rule.kind == "copy":
        return [tensor]
    if rule.kind == "gate_up":
        return list(torch.chunk(tensor, 2, dim=0))
    if rule.kind in mla.ROPE_KINDS:
        return mla.to_hf(rule, tensor, arch)
    groups, q_width, kv_width = _qkv_groups(arch)
    tail = tensor.shape[1:]
    q, k, v = tensor.reshape(groups, q_width + 2 * kv_width, *tail).split([q_width, kv_width, kv_width], dim=1)
    return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]
