"""Architecture read from a Hugging Face `config.json` -> Megatron-Core `TransformerConfig` + GPTModel arguments.

Nothing is mirrored by hand: every architectural number comes from config.json. A field whose value the bridge
cannot honour raises `UnsupportedConfig` naming the field, instead of silently training a different model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from slimish.megatron_bridge import fp8, known_models, mla_config, moe_config
from slimish.megatron_bridge.errors import CheckpointError, UnsupportedConfig
from slimish.megatron_bridge.mla_config import MLA
from slimish.megatron_bridge.moe_config import MoE

__all__ = ["MLA", "MoE", "UnsupportedConfig"]


DENSE_FAMILIES = {"llama", "qwen2", "qwen3"}
# family -> reader of its sparse MLP
MOE_FAMILIES = {"qwen3_moe": moe_config.qwen3_moe, "glm4_moe": moe_config.deepseek_style,
                "deepseek_v3": moe_config.deepseek_style}
MLA_FAMILIES = {"deepseek_v3"}  # multi-latent attention
QK_NORM_FAMILIES = {"qwen3", "qwen3_moe"}
# head_dim where config.json omits it: transformers' Qwen3Config defaults it to 128 (so do the engines, which read
# config.json through transformers); the other families' configs to hidden_size // num_attention_heads.
_DEFAULT_HEAD_DIM = {"qwen3": 128}


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
    rotary_percent: float = 1.0
    rope_llama3_factor: float | None = None
    norm_eps: float
    qk_layernorm: bool
    add_qkv_bias: bool
    tie_word_embeddings: bool
    moe: MoE | None = None
    mla: MLA | None = None
    # Multi-token-prediction layers (DeepSeek-V3 / GLM-4.5 num_nextn_predict_layers), stored after the decoder
    # layers as model.layers.{num_layers + k}.*: the bridge neither builds nor exports them (dense.is_mtp_tensor).
    mtp_layers: int = 0


def read_hf_config(path: str | Path) -> dict:
    """config.json of the HF model directory `path` (or the file itself); where no such path exists, the released
    config.json fields of the known model of that name (`known_models.KNOWN`: planning before the download)."""
    known = known_models.known_config(str(path)) if not Path(path).exists() else None
    if known is not None:
        return known
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face model directory (config.json and "
                              "safetensors weights), its config.json, or (to plan) one of the known models: "
                              f"{', '.join(known_models.KNOWN)}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot read it as JSON ({exc}); restore the model's config.json") from None


@dataclass(frozen=True, kw_only=True)
class Rope:
    base: float
    percent: float = 1.0  # the share of each head's channels that rotate (GLM-4.5: partial_rotary_factor 0.5)
    llama3_factor: float | None = None  # Llama-3.1 frequency scaling


# Megatron's Llama-3.1 scaling has these fixed (Llama-3.1/3.2/3.3 all ship them).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_parameters(cfg: dict) -> tuple[dict, str]:
    """(RoPE fields, the config.json field they come from). transformers 5 writes rope_parameters (rope_theta,
    rope_type and the scaling fields together); older configs keep rope_theta and partial_rotary_factor at the top
    level and the scaling in rope_scaling, which then wins."""
    params = {k: cfg[k] for k in ("rope_theta", "partial_rotary_factor") if cfg.get(k) is not None}
    params.update(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    if "type" in legacy:
        legacy.setdefault("rope_type", legacy.pop("type"))
    return {**params, **legacy}, "rope_scaling" if legacy else "rope_parameters"


def _rope(cfg: dict) -> Rope:
    params, source = _rope_parameters(cfg)
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise UnsupportedConfig(f"{source}.rope_type", rope_type, "supported: default, llama3")
    theta = params.get("rope_theta")
    if theta is None:
        raise UnsupportedConfig("rope_theta", None, "missing; cannot derive the rotary base")
    percent = float(params.get("partial_rotary_factor", 1.0))
    if not 0.0 < percent <= 1.0:
        raise UnsupportedConfig("partial_rotary_factor", percent, "must be in (0, 1]")
    if rope_type == "default":
        return Rope(base=float(theta), percent=percent)
    for field, value in _LLAMA3_FIXED.items():
        if float(params.get(field, value)) != value:
            raise UnsupportedConfig(f"{source}.{field}", params[field],
                                    f"Megatron-Core's Llama-3 RoPE scaling has {field}={value}")
    return Rope(base=float(theta), percent=percent, llama3_factor=float(params["factor"]))


def _attention_bias_and_qk_norm(cfg: dict, family: str) -> tuple[bool, bool]:
    """(q/k/v biases, per-head q/k RMSNorm). Megatron's biases are all-or-none per kind: q/k/v together
    (add_qkv_bias), the output projection never."""
    bias = bool(cfg.get("attention_bias", family == "qwen2"))
    if family == "glm4_moe":
        return bias, bool(cfg.get("use_qk_norm", False))  # GLM-4.5's attention_bias is q/k/v only
    if family == "llama":
        if bias:
            raise UnsupportedConfig("attention_bias", True, "Llama attention biases (q/k/v/o) are not supported")
        if cfg.get("mlp_bias"):
            raise UnsupportedConfig("mlp_bias", True, "MLP biases are not supported")
    if family in QK_NORM_FAMILIES and bias:
        raise UnsupportedConfig("attention_bias", True, "Qwen3 with attention biases is not supported")
    return bias or family == "qwen2", family in QK_NORM_FAMILIES


def _check_common(cfg: dict) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfig("hidden_act", cfg["hidden_act"], "only SwiGLU (silu) MLPs are supported")
    if cfg.get("use_sliding_window"):
        raise UnsupportedConfig("use_sliding_window", True, "sliding-window attention is not supported")
    if cfg.get("attention_dropout", 0.0):
        raise UnsupportedConfig("attention_dropout", cfg["attention_dropout"], "RL trains without dropout")
    fp8.block_size(cfg)  # block-scaled FP8 is read as bf16 (hf_io); any other quantization is refused here


def architecture_from_hf(cfg: dict) -> Architecture:
    """The Megatron architecture of config.json `cfg`; anything the bridge cannot honour, or a field its family needs
    that is missing, is an `UnsupportedConfig` naming the field."""
    try:
        return _architecture(cfg)
    except KeyError as exc:
        raise UnsupportedConfig(exc.args[0], None, "missing; every config.json of this model type has it") from None


def _architecture(cfg: dict) -> Architecture:
    family = cfg.get("model_type")
    if family not in DENSE_FAMILIES | set(MOE_FAMILIES):
        raise UnsupportedConfig("model_type", family,
                                f"supported families: {', '.join(sorted(DENSE_FAMILIES | set(MOE_FAMILIES)))}")
    _check_common(cfg)
    heads = cfg["num_attention_heads"]
    common = dict(family=family, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                  ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=heads, vocab_size=cfg["vocab_size"],
                  max_position_embeddings=cfg["max_position_embeddings"], norm_eps=cfg["rms_norm_eps"],
                  tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                  moe=MOE_FAMILIES[family](cfg) if family in MOE_FAMILIES else None,
                  mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))
    if family in MLA_FAMILIES:
        mla = mla_config.mla_from_hf(cfg)
        # Megatron's core attention sizes its output by kv_channels per head: the value head width.
        return Architecture(**common, num_query_groups=heads, kv_channels=mla.v_head_dim,
                            rotary_base=mla.rotary_base, qk_layernorm=False, add_qkv_bias=False, mla=mla)
    add_qkv_bias, qk_layernorm = _attention_bias_and_qk_norm(cfg, family)
    rope = _rope(cfg)
    return Architecture(**common, num_query_groups=cfg.get("num_key_value_heads") or heads,
                        kv_channels=cfg.get("head_dim") or _DEFAULT_HEAD_DIM.get(family, cfg["hidden_size"] // heads),
                        rotary_base=rope.base,
                        rotary_percent=rope.percent, rope_llama3_factor=rope.llama3_factor,
                        qk_layernorm=qk_layernorm, add_qkv_bias=add_qkv_bias)


def transformer_config(arch: Architecture, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       expert_parallel: int = 1, expert_tensor_parallel: int = 0, params_dtype=None,
                       use_cpu_initialization: bool = False, sequence_parallel: bool = False,
                       context_parallel: int = 1, cp_comm_type: str = "p2p", first_stage_layers: int = 0,
                       last_stage_layers: int = 0, virtual_pipeline: int = 1, **overrides):
    """The Megatron-Core TransformerConfig for `arch` (dropout off: RL logprobs must be deterministic).
    `expert_tensor_parallel`: how many ranks split each expert (0: tensor_parallel, as Megatron's default)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    dtype = params_dtype or torch.float32
    config_class, mla = TransformerConfig, {}
    if arch.mla is not None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class, mla = MLATransformerConfig, mla_config.megatron_fields(arch.mla)
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
        # Uneven stages (`pipeline_stage_layers`); None: Megatron's even split.
        num_layers_in_first_pipeline_stage=first_stage_layers or None,
        num_layers_in_last_pipeline_stage=last_stage_layers or None,
        virtual_pipeline_model_parallel_size=virtual_pipeline if virtual_pipeline > 1 else None,
        sequence_parallel=sequence_parallel and tensor_parallel > 1,  # Megatron: a no-op at TP1
        context_parallel_size=context_parallel,
        cp_comm_type=cp_comm_type,  # read by Transformer Engine's attention only
        params_dtype=dtype,
        pipeline_dtype=dtype,  # activations cross pipeline stages in the parameter dtype
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu_initialization,
        **moe_config.megatron_fields(arch.moe, expert_parallel=expert_parallel,
                                     expert_tensor_parallel=expert_tensor_parallel or tensor_parallel),
        **mla,
        **overrides,
    )


def pipeline_stage_layers(num_layers: int, pipeline_parallel: int, *, first: int = 0, last: int = 0,
                          virtual_pipeline: int = 1) -> list[int]:
    """The transformer layers on each pipeline stage, as Megatron-Core splits them: `first` / `last` on the first /
    last stage when given (0: not given), the other stages an even share of the rest; with `virtual_pipeline` > 1
    each stage's layers in that many equal chunks. Raises ValueError, saying what Megatron would refuse, for a split
    it cannot make."""
    counts = _stage_layers(num_layers, pipeline_parallel, first=first, last=last)
    if virtual_pipeline > 1:
        if pipeline_parallel <= 2:
            # With two stages a rank's previous and next stage are the same rank: Megatron's interleaved schedule
            # then receives activations and gradients crossed (measured: PP2 x VPP2 on gloo trained wrongly).
            raise ValueError(f"an interleaved pipeline (virtual_pipeline {virtual_pipeline}) needs pipeline_parallel "
                             f"> 2, got {pipeline_parallel}")
        if any(count % virtual_pipeline for count in counts):
            raise ValueError(f"stage layer counts {counts} do not split into {virtual_pipeline} virtual-pipeline "
                             "chunks each; change parallel.virtual_pipeline or the stage layer counts")
    return counts


def _stage_layers(num_layers: int, pipeline_parallel: int, *, first: int, last: int) -> list[int]:
    if pipeline_parallel == 1:
        if first or last:
            raise ValueError("first / last stage layer counts need pipeline_parallel > 1")
        return [num_layers]
    fixed = {0: first, pipeline_parallel - 1: last}
    fixed = {stage: count for stage, count in fixed.items() if count}
    if any(count < 1 for count in fixed.values()) or first < 0 or last < 0:
        raise ValueError("stage layer counts must be positive")
    rest, stages = num_layers - sum(fixed.values()), pipeline_parallel - len(fixed)
    if rest < stages or (stages and rest % stages) or (not stages and rest):
        given = f" after {sum(fixed.values())} on the first / last stage" if fixed else ""
        raise ValueError(f"{num_layers} layers do not split over {pipeline_parallel} pipeline stages: {rest} "
                         f"layers{given} over {stages} stage(s) is not an even whole number of at least one; "
                         f"set parallel.first_stage_layers / last_stage_layers")
    share = rest // stages if stages else 0
    return [fixed.get(stage, share) for stage in range(pipeline_parallel)]


def gpt_model_kwargs(arch: Architecture) -> dict:
    """Arguments of megatron.core.models.gpt.GPTModel besides config and layer spec."""
    return dict(
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
        rotary_percent=arch.rotary_percent,
        rope_scaling=arch.rope_llama3_factor is not None,
        rope_scaling_factor=arch.rope_llama3_factor or 8.0,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
    )
