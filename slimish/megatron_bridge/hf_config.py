"""Architecture read from a Hugging Face `config.json` -> Megatron-Core `TransformerConfig` + GPTModel arguments.

Nothing is mirrored by hand: every architectural number comes from config.json. A field whose value the bridge
cannot honour raises `UnsupportedConfig` naming the field, instead of silently training a different model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class UnsupportedConfig(ValueError):
    """config.json asks for something the bridge cannot reproduce in Megatron-Core."""

    def __init__(self, field: str, value, why: str):
        super().__init__(f"config.json field '{field}'={value!r}: {why}")
        self.field = field


DENSE_FAMILIES = {"llama", "qwen2", "qwen3"}


@dataclass(frozen=True, kw_only=True)
class Architecture:
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    norm_eps: float
    qk_layernorm: bool
    add_qkv_bias: bool
    tie_word_embeddings: bool


def read_hf_config(path: str | Path) -> dict:
    path = Path(path)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedConfig("rope_parameters.rope_type", rope_type, "only default RoPE is supported yet")
    if cfg.get("rope_scaling"):
        raise UnsupportedConfig("rope_scaling", cfg["rope_scaling"], "RoPE scaling is not supported yet")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise UnsupportedConfig("rope_theta", None, "missing; cannot derive the rotary base")
    return float(theta)


def architecture_from_hf(cfg: dict) -> Architecture:
    family = cfg.get("model_type")
    if family not in DENSE_FAMILIES:
        raise UnsupportedConfig("model_type", family, f"supported families: {', '.join(sorted(DENSE_FAMILIES))}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfig("hidden_act", cfg["hidden_act"], "only SwiGLU (silu) MLPs are supported")
    if cfg.get("use_sliding_window"):
        raise UnsupportedConfig("use_sliding_window", True, "sliding-window attention is not supported")
    if cfg.get("attention_dropout", 0.0):
        raise UnsupportedConfig("attention_dropout", cfg["attention_dropout"], "RL trains without dropout")
    if family == "llama" and cfg.get("mlp_bias"):
        raise UnsupportedConfig("mlp_bias", True, "MLP biases are not supported")
    heads = cfg["num_attention_heads"]
    attention_bias = cfg.get("attention_bias", family == "qwen2")
    if family == "llama" and attention_bias:
        raise UnsupportedConfig("attention_bias", True, "Llama attention biases (q/k/v/o) are not supported")
    if family == "qwen3" and attention_bias:
        raise UnsupportedConfig("attention_bias", True, "Qwen3 with attention biases is not supported")
    return Architecture(
        family=family,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rotary_base=_rope_theta(cfg),
        norm_eps=cfg["rms_norm_eps"],
        qk_layernorm=family == "qwen3",
        add_qkv_bias=family == "qwen2",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def transformer_config(arch: Architecture, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       params_dtype=None, use_cpu_initialization: bool = False, **overrides):
    """The Megatron-Core TransformerConfig for `arch` (dropout off: RL logprobs must be deterministic)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    dtype = params_dtype or torch.float32
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,  # activations cross pipeline stages in the parameter dtype
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu_initialization,
        **overrides,
    )


def gpt_model_kwargs(arch: Architecture) -> dict:
    """Arguments of megatron.core.models.gpt.GPTModel besides config and layer spec."""
    return dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
        rotary_percent=1.0,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
    )
