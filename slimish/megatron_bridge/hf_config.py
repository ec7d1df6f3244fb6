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
MOE_FAMILIES = {"qwen3_moe"}
QK_NORM_FAMILIES = {"qwen3", "qwen3_moe"}


@dataclass(frozen=True, kw_only=True)
class MoE:
    """The sparse MLP of a mixture-of-experts family."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    # One entry per decoder layer: 1 for a sparse (MoE) MLP, 0 for a dense one (Megatron's moe_layer_freq list).
    layer_pattern: tuple[int, ...]
    # HF renormalises the top-k softmax probabilities (norm_topk_prob), i.e. softmax over the top-k logits: that
    # is Megatron's default order (top-k, then softmax). Without renormalisation HF weighs experts by their share
    # of the softmax over all experts: Megatron's pre-softmax order.
    pre_softmax: bool

    def is_sparse(self, layer: int) -> bool:
        return bool(self.layer_pattern[layer])


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
    moe: MoE | None = None


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


def _moe(cfg: dict) -> MoE:
    """Qwen3-MoE's sparse MLP. Its router aux-loss coefficient (router_aux_loss_coef) is a training choice, not
    architecture: the trainer runs without a load-balancing loss (see `transformer_config`)."""
    # transformers 5 writes num_experts as num_local_experts (its attribute map); older configs use num_experts.
    experts_field = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    experts = cfg.get(experts_field)
    if not experts or experts < 1:
        raise UnsupportedConfig(experts_field, experts, "a qwen3_moe model needs at least one expert")
    topk = cfg["num_experts_per_tok"]
    if not 1 <= topk <= experts:
        raise UnsupportedConfig("num_experts_per_tok", topk, f"must be between 1 and num_experts={experts}")
    step = cfg.get("decoder_sparse_step", 1)
    if step < 1:
        raise UnsupportedConfig("decoder_sparse_step", step, "must be >= 1")
    dense_layers = set(cfg.get("mlp_only_layers") or [])
    layers = cfg["num_hidden_layers"]
    # Qwen3MoeDecoderLayer's rule: sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th.
    pattern = tuple(int(i not in dense_layers and (i + 1) % step == 0) for i in range(layers))
    if not any(pattern):
        field, value = ("mlp_only_layers", sorted(dense_layers)) if dense_layers else ("decoder_sparse_step", step)
        raise UnsupportedConfig(field, value, "no layer is sparse; use the dense family")
    return MoE(num_experts=experts, topk=topk, ffn_hidden_size=cfg["moe_intermediate_size"], layer_pattern=pattern,
               pre_softmax=not cfg.get("norm_topk_prob", False))


def architecture_from_hf(cfg: dict) -> Architecture:
    family = cfg.get("model_type")
    if family not in DENSE_FAMILIES | MOE_FAMILIES:
        raise UnsupportedConfig("model_type", family,
                                f"supported families: {', '.join(sorted(DENSE_FAMILIES | MOE_FAMILIES))}")
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
    if family in QK_NORM_FAMILIES and attention_bias:
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
        qk_layernorm=family in QK_NORM_FAMILIES,
        add_qkv_bias=family == "qwen2",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        moe=_moe(cfg) if family in MOE_FAMILIES else None,
    )


def _moe_config(moe: MoE | None, *, expert_parallel: int) -> dict:
    """TransformerConfig fields of the sparse MLP (none for a dense model)."""
    if moe is None:
        if expert_parallel != 1:
            raise ValueError(f"expert_parallel={expert_parallel} needs a mixture-of-experts model")
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=list(moe.layer_pattern),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=moe.pre_softmax,
        # No load-balancing loss: the forward pass then equals HF's exactly, and RL fine-tuning of a trained router
        # does not need one. Switch it on here (type "aux_loss" + a coefficient) if routing collapses.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        # The dispatcher made for expert parallelism; at EP=1 it only permutes locally.
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,  # grouped GEMM needs Transformer Engine / CUDA kernels
        expert_model_parallel_size=expert_parallel,
    )


def transformer_config(arch: Architecture, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       expert_parallel: int = 1, params_dtype=None, use_cpu_initialization: bool = False,
                       **overrides):
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
        **_moe_config(arch.moe, expert_parallel=expert_parallel),
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
