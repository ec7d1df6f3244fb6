"""The tensor names and shapes a Hugging Face config.json implies, so that a checkpoint whose weights do not fit its
config is refused before (or, in a background check, before committing) a conversion.

Two sources, equal on every family slimish supports (tests/megatron_bridge/test_hf_shapes.py compares them):
  * `known_hf_shapes`: worked out from config.json alone for the supported families (`KNOWN_FAMILIES`), as their
    transformers modeling code sizes each module. Microseconds, and no transformers import (4-5 s of CPU).
  * `transformers_hf_shapes`: transformers' own model built on the meta device (no memory, no weights), for any
    family transformers knows. `expected_hf_shapes` uses it where the config is not one of the known families, or
    when asked.
"""

from __future__ import annotations

import torch

from slimish.megatron_bridge.errors import CheckpointError
from slimish.megatron_bridge.hf_config import DENSE_FAMILIES, MOE_FAMILIES, Architecture, architecture_from_hf

# model_type values whose tensors `known_hf_shapes` describes: every family `hf_config` accepts.
KNOWN_FAMILIES = frozenset(DENSE_FAMILIES | set(MOE_FAMILIES))


def expected_hf_shapes(cfg: dict, *, transformers: bool = False) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors a checkpoint of `cfg` holds (multi-token-prediction layers excepted, as
    transformers builds none): from config.json alone for a known family, else (or with `transformers`) from
    transformers' model."""
    if not transformers and cfg.get("model_type") in KNOWN_FAMILIES:
        return known_hf_shapes(cfg)
    return transformers_hf_shapes(cfg)


def transformers_hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors transformers writes for `cfg` (save_pretrained's own reversal of its
    in-memory layout, e.g. fused experts back to one tensor per expert)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **fields))
        saved = revert_weight_conversion(model, model.state_dict())
    return {name: tuple(t.shape) for name, t in saved.items()}


def known_hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors of `cfg`, a config.json of one of `KNOWN_FAMILIES`, from its fields alone
    (the sizes `hf_config.architecture_from_hf` reads, which refuses what the bridge cannot honour)."""
    arch = architecture_from_hf(cfg)
    hidden, vocab = arch.hidden_size, arch.vocab_size
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(arch.num_layers):
        prefix = f"model.layers.{i}."
        attention = _mla_shapes(arch) if arch.mla is not None else _attention_shapes(arch)
        shapes.update({f"{prefix}self_attn.{name}": shape for name, shape in attention.items()})
        shapes.update({f"{prefix}mlp.{name}": shape for name, shape in _mlp_shapes(arch, i).items()})
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    # Listed when tied too, as transformers' state_dict lists it (save_pretrained then writes the embedding alone).
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _attention_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Grouped-query attention: q/k/v/o projections of head_dim (kv_channels) per head, q/k/v biases where the
    family has them (Qwen2 always, GLM-4.5 with attention_bias), per-head q/k RMSNorm (Qwen3, GLM-4.5 use_qk_norm)."""
    q, kv = arch.num_attention_heads * arch.kv_channels, arch.num_query_groups * arch.kv_channels
    shapes = {"q_proj.weight": (q, arch.hidden_size), "k_proj.weight": (kv, arch.hidden_size),
              "v_proj.weight": (kv, arch.hidden_size), "o_proj.weight": (arch.hidden_size, q)}
    if arch.add_qkv_bias:
        shapes.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
    if arch.qk_layernorm:
        shapes.update({"q_norm.weight": (arch.kv_channels,), "k_norm.weight": (arch.kv_channels,)})
    return shapes


def _mla_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """DeepSeek multi-latent attention: q through a low-rank latent (or one full-rank q_proj), k/v through one
    latent shared by the heads plus the shared rotary key (no biases: `mla_config` refuses attention_bias)."""
    mla, hidden, heads = arch.mla, arch.hidden_size, arch.num_attention_heads
    qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank is None:
        shapes = {"q_proj.weight": (heads * qk_head, hidden)}
    else:
        shapes = {"q_a_proj.weight": (mla.q_lora_rank, hidden), "q_a_layernorm.weight": (mla.q_lora_rank,),
                  "q_b_proj.weight": (heads * qk_head, mla.q_lora_rank)}
    return {**shapes, "kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, hidden),
            "kv_a_layernorm.weight": (mla.kv_lora_rank,),
            "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
            "o_proj.weight": (hidden, heads * mla.v_head_dim)}


def _swiglu(prefix: str, width: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}gate_proj.weight": (width, hidden), f"{prefix}up_proj.weight": (width, hidden),
            f"{prefix}down_proj.weight": (hidden, width)}


def _mlp_shapes(arch: Architecture, i: int) -> dict[str, tuple[int, ...]]:
    """Layer `i`'s MLP: a dense SwiGLU of intermediate_size, or the sparse layer's router (and its correction
    bias), per-expert SwiGLUs of moe_intermediate_size and the shared experts as one SwiGLU."""
    hidden, moe = arch.hidden_size, arch.moe
    if moe is None or not moe.is_sparse(i):
        return _swiglu("", arch.ffn_hidden_size, hidden)
    shapes = {"gate.weight": (moe.num_experts, hidden)}
    if moe.expert_bias:
        shapes["gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes.update(_swiglu(f"experts.{e}.", moe.ffn_hidden_size, hidden))
    if moe.shared_ffn_hidden_size:
        shapes.update(_swiglu("shared_experts.", moe.shared_ffn_hidden_size, hidden))
    return shapes


def check_shapes(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], *, source: str,
                 config: str) -> None:
    """Raise `CheckpointError` naming the first tensor of `found` whose shape is not the one `config` implies."""
    for name, shape in found.items():
        want = expected.get(name)
        if want is not None and tuple(shape) != want:
            raise CheckpointError(f"{source}: {name} has shape {tuple(shape)} but {config} implies {want}: the "
                                  "weights and the config are of different models; pass the matching config.json")
