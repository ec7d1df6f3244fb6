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
MLA_FAMILIES = {"deepseek_v3"}  # multi-latent attention
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
class MLA:
    """DeepSeek multi-latent attention: low-rank (LoRA-like) query and key/value projections, a decoupled RoPE part
    of qk_rope_head_dim per head (the key's shared by all heads), and its rotary embedding.

    The rotary fields are Megatron's (MLATransformerConfig), already translated from HF's rope parameters: Megatron
    derives both the cos/sin concentration factor and the softmax-scale factor from (scaling_factor, mscale,
    mscale_all_dim) the way transformers does once `mla_rope` has chosen them.
    """

    q_lora_rank: int | None  # None: one full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # HF rope_interleave: the rotary dims of q/k are (x0, x1), (x2, x3), ... pairs, as Megatron's MLA always reads
    # them. False: (x_j, x_{j+d/2}) pairs; the bridge then permutes the rotary rows of the q and kv-down weights.
    rope_interleave: bool
    rope_type: str  # "rope" | "yarn" (Megatron's names)
    rotary_base: float
    scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


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
    mla: MLA | None = None
    # Multi-token-prediction layers (DeepSeek's num_nextn_predict_layers), stored after the decoder layers as
    # model.layers.{num_layers + k}.*: the bridge neither builds nor exports them (see dense.is_mtp_tensor).
    mtp_layers: int = 0


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


def mla_rope(cfg: dict) -> dict:
    """MLA's rotary fields (of `MLA`) from HF's rope parameters (transformers 5 `rope_parameters`, or the legacy
    `rope_scaling` + `rope_theta` that DeepSeek-V3's config.json ships), as transformers reads them.

    transformers' yarn: inv_freq blends extrapolated / interpolated frequencies over the correction range of
    (beta_fast, beta_slow) at original_max_position_embeddings; cos/sin are scaled by attention_factor =
    m(factor, mscale) / m(factor, mscale_all_dim) when both are set, else m(factor); the softmax scale is
    qk_head_dim**-0.5 * m(factor, mscale_all_dim)**2 when mscale_all_dim is set. Megatron computes the same with
    the ratio always, so mscale=1 and mscale_all_dim=0 stand for "unset".
    """
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfig(f"{field}.partial_rotary_factor", params["partial_rotary_factor"],
                                "MLA rotates the whole qk_rope_head_dim")
    if rope_type == "default":
        return dict(rope_type="rope", rotary_base=float(theta))
    if rope_type != "yarn":
        raise UnsupportedConfig(f"{field}.rope_type", rope_type, "MLA supports default and yarn RoPE")
    factor = params.get("factor")
    if not factor or factor < 1:
        raise UnsupportedConfig(f"{field}.factor", factor, "yarn needs a scaling factor >= 1")
    if params.get("attention_factor") is not None:
        raise UnsupportedConfig(f"{field}.attention_factor", params["attention_factor"],
                                "Megatron derives the cos/sin factor from mscale / mscale_all_dim only")
    if not params.get("truncate", True):
        raise UnsupportedConfig(f"{field}.truncate", False, "Megatron rounds the yarn correction range")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        # HF: cos/sin factor m(factor) (mscale ignored), softmax factor m(factor, mscale_all_dim)**2; Megatron
        # would scale cos/sin by m(factor, mscale) / m(factor, mscale_all_dim).
        raise UnsupportedConfig(f"{field}.mscale", mscale, "mscale_all_dim without mscale has no Megatron match")
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    return dict(rope_type="yarn", rotary_base=float(theta), scaling_factor=float(factor),
                original_max_position_embeddings=int(original or cfg["max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                mscale=float(mscale) if mscale_all_dim else 1.0, mscale_all_dim=float(mscale_all_dim or 0.0))


def _mla(cfg: dict) -> MLA:
    """DeepSeek-V3's attention; its MoE layers are not supported yet (every layer must be dense)."""
    layers = cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 3)
    if first_dense is None or first_dense < layers:
        raise UnsupportedConfig("first_k_dense_replace", first_dense,
                                f"DeepSeek MoE layers are not supported yet; needs >= num_hidden_layers={layers}")
    if cfg.get("quantization_config"):
        raise UnsupportedConfig("quantization_config", cfg["quantization_config"].get("quant_method"),
                                "FP8 block-quantized weights: convert the checkpoint to bf16 first")
    if cfg.get("attention_bias"):
        raise UnsupportedConfig("attention_bias", True, "Megatron's MLA projections have no biases")
    heads = cfg["num_attention_heads"]
    if (cfg.get("num_key_value_heads") or heads) != heads:
        raise UnsupportedConfig("num_key_value_heads", cfg["num_key_value_heads"],
                                f"MLA expands keys/values to every head; must equal num_attention_heads={heads}")
    if cfg["rms_norm_eps"] != 1e-6:
        # HF's q_a_layernorm / kv_a_layernorm always use eps 1e-6; Megatron uses one eps for every norm.
        raise UnsupportedConfig("rms_norm_eps", cfg["rms_norm_eps"], "DeepSeek's latent norms use 1e-6")
    return MLA(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
               qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
               v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)), **mla_rope(cfg))


def architecture_from_hf(cfg: dict) -> Architecture:
    family = cfg.get("model_type")
    families = DENSE_FAMILIES | MOE_FAMILIES | MLA_FAMILIES
    if family not in families:
        raise UnsupportedConfig("model_type", family, f"supported families: {', '.join(sorted(families))}")
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
    if family in MLA_FAMILIES:
        mla = _mla(cfg)
        return Architecture(
            family=family, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=heads, num_query_groups=heads,
            # Megatron's core attention sizes its output by kv_channels per head: the value head width.
            kv_channels=mla.v_head_dim, vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg["max_position_embeddings"], rotary_base=mla.rotary_base,
            norm_eps=cfg["rms_norm_eps"], qk_layernorm=False, add_qkv_bias=False,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), mla=mla,
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))
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


def _mla_config(mla: MLA) -> dict:
    """MLATransformerConfig fields (Megatron calls the nope part of a q/k head qk_head_dim)."""
    return dict(
        q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, rope_type=mla.rope_type,
        rotary_base=mla.rotary_base, rotary_scaling_factor=mla.scaling_factor,
        original_max_position_embeddings=mla.original_max_position_embeddings, beta_fast=mla.beta_fast,
        beta_slow=mla.beta_slow, mscale=mla.mscale, mscale_all_dim=mla.mscale_all_dim,
        # Megatron's MLA always reads the rotary dims as interleaved pairs (multi_latent_attention in rope_utils);
        # rotary_interleaved would interleave a second time.
        rotary_interleaved=False,
    )


def transformer_config(arch: Architecture, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       expert_parallel: int = 1, params_dtype=None, use_cpu_initialization: bool = False,
                       **overrides):
    """The Megatron-Core TransformerConfig for `arch` (dropout off: RL logprobs must be deterministic)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    dtype = params_dtype or torch.float32
    config_class, mla = TransformerConfig, {}
    if arch.mla is not None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class, mla = MLATransformerConfig, _mla_config(arch.mla)
    return config_class(
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
        qk_layernorm=arch.qk_layernorm or arch.mla is not None,  # MLA: builds the q / kv latent norms
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
        **mla,
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
