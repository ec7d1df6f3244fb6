"""The sparse MLP of a mixture-of-experts family, read from config.json, and the Megatron-Core fields that
reproduce it.

Two router designs exist among the target families:
  * Qwen3-MoE: softmax scores, top-k, optional renormalisation (norm_topk_prob), no shared expert.
  * DeepSeek-V3 / GLM-4.5 ("DeepSeek style"): sigmoid scores; experts are *chosen* on score + a per-expert
    correction bias (e_score_correction_bias) but *weighted* by the plain score; optional group-limited choice
    (n_group / topk_group); chosen weights renormalised and multiplied by routed_scaling_factor; the first
    first_k_dense_replace layers are dense; every sparse layer adds shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimish.megatron_bridge.errors import UnsupportedConfig

# HF's group-limited routing ranks a group by the sum of its best two scores (a constant in transformers);
# Megatron ranks it by the sum of its best topk // group_topk: they agree only when that ratio is 2.
_HF_GROUP_SCORE_TOPK = 2


@dataclass(frozen=True, kw_only=True)
class MoE:
    num_experts: int
    topk: int
    ffn_hidden_size: int
    # One entry per decoder layer: 1 for a sparse (MoE) MLP, 0 for a dense one (Megatron's moe_layer_freq list).
    layer_pattern: tuple[int, ...]
    score_function: str = "softmax"  # "softmax" | "sigmoid"
    # Softmax only. HF renormalises the top-k probabilities (norm_topk_prob), i.e. softmax over the top-k logits:
    # Megatron's default order (top-k, then softmax). Without renormalisation HF weighs experts by their share of
    # the softmax over all experts: Megatron's pre-softmax order.
    pre_softmax: bool = False
    expert_bias: bool = False  # a routing-only per-expert bias (HF: gate.e_score_correction_bias)
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    shared_ffn_hidden_size: int | None = None  # all shared experts as one MLP of this width

    def is_sparse(self, layer: int) -> bool:
        return bool(self.layer_pattern[layer])


def _experts_and_topk(cfg: dict, experts_fields: tuple[str, ...]) -> tuple[int, int]:
    field = next((f for f in experts_fields if f in cfg), experts_fields[0])
    experts = cfg.get(field)
    if not experts or experts < 1:
        raise UnsupportedConfig(field, experts, "a mixture-of-experts model needs at least one expert")
    topk = cfg.get("num_experts_per_tok")
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        raise UnsupportedConfig("num_experts_per_tok", topk, f"must be between 1 and {field}={experts}")
    return experts, topk


def _check_some_sparse(pattern: tuple[int, ...], field: str, value) -> None:
    if not any(pattern):
        raise UnsupportedConfig(field, value, "no layer is sparse; use the dense family")


def qwen3_moe(cfg: dict) -> MoE:
    """Qwen3-MoE. Its router aux-loss coefficient (router_aux_loss_coef) is a training choice, not architecture:
    the trainer runs without a load-balancing loss (see `megatron_fields`)."""
    # transformers 5 writes num_experts as num_local_experts (its attribute map); older configs use num_experts.
    experts, topk = _experts_and_topk(cfg, ("num_local_experts", "num_experts"))
    step = cfg.get("decoder_sparse_step", 1)
    if step < 1:
        raise UnsupportedConfig("decoder_sparse_step", step, "must be >= 1")
    dense_layers = set(cfg.get("mlp_only_layers") or [])
    # Qwen3MoeDecoderLayer's rule: sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th.
    pattern = tuple(int(i not in dense_layers and (i + 1) % step == 0) for i in range(cfg["num_hidden_layers"]))
    field, value = ("mlp_only_layers", sorted(dense_layers)) if dense_layers else ("decoder_sparse_step", step)
    _check_some_sparse(pattern, field, value)
    return MoE(num_experts=experts, topk=topk, ffn_hidden_size=cfg["moe_intermediate_size"], layer_pattern=pattern,
               pre_softmax=not cfg.get("norm_topk_prob", False))


def deepseek_style(cfg: dict) -> MoE | None:
    """DeepSeek-V3 and GLM-4.5 (Glm4MoeTopkRouter is DeepseekV3TopkRouter); None when first_k_dense_replace
    leaves no layer sparse."""
    experts, topk = _experts_and_topk(cfg, ("n_routed_experts", "num_local_experts"))
    scoring = cfg.get("scoring_func", "sigmoid")  # original DeepSeek configs name it; transformers hard-codes it
    if scoring != "sigmoid":
        raise UnsupportedConfig("scoring_func", scoring, "DeepSeek-style routers are supported with sigmoid only")
    method = cfg.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise UnsupportedConfig("topk_method", method, "only noaux_tc (bias-corrected choice) is supported")
    # Megatron renormalises the chosen sigmoid scores exactly when top-k > 1; HF when norm_topk_prob is set.
    if topk > 1 and not cfg.get("norm_topk_prob", True):
        raise UnsupportedConfig("norm_topk_prob", False, "Megatron renormalises sigmoid router weights when top-k > 1")
    if topk == 1 and cfg.get("norm_topk_prob", True):
        raise UnsupportedConfig("num_experts_per_tok", 1, "with norm_topk_prob HF gives the one chosen expert weight "
                                "1, Megatron its sigmoid score")
    first_dense = cfg.get("first_k_dense_replace") or 0
    freq = cfg.get("moe_layer_freq", 1)
    if freq != 1:
        raise UnsupportedConfig("moe_layer_freq", freq, "only every layer after first_k_dense_replace may be sparse")
    pattern = tuple(int(i >= first_dense) for i in range(cfg["num_hidden_layers"]))
    if not any(pattern):
        return None  # every layer dense (HF builds that too): no sparse MLP to describe
    num_groups, group_topk = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    if num_groups > 1:
        if experts % num_groups:
            raise UnsupportedConfig("n_group", num_groups, f"must divide the {experts} routed experts")
        if not 1 <= group_topk <= num_groups:
            raise UnsupportedConfig("topk_group", group_topk, f"must be between 1 and n_group={num_groups}")
        if topk // group_topk != _HF_GROUP_SCORE_TOPK:
            raise UnsupportedConfig("topk_group", group_topk,
                                    f"HF ranks expert groups by their top-{_HF_GROUP_SCORE_TOPK} scores, Megatron by "
                                    f"their top num_experts_per_tok // topk_group = {topk // group_topk}")
    elif experts < _HF_GROUP_SCORE_TOPK:
        raise UnsupportedConfig("n_routed_experts", experts, "HF's router needs at least two experts")
    shared = cfg.get("n_shared_experts") or 0
    scale = float(cfg.get("routed_scaling_factor", 1.0))
    return MoE(num_experts=experts, topk=topk, ffn_hidden_size=cfg["moe_intermediate_size"], layer_pattern=pattern,
               score_function="sigmoid", expert_bias=True,
               num_groups=num_groups if num_groups > 1 else None, group_topk=group_topk if num_groups > 1 else None,
               scaling_factor=scale if scale != 1.0 else None,
               shared_ffn_hidden_size=cfg["moe_intermediate_size"] * shared if shared else None)


def megatron_fields(moe: MoE | None, *, expert_parallel: int, expert_tensor_parallel: int | None = None) -> dict:
    """TransformerConfig fields of the sparse MLP (none for a dense model). `expert_tensor_parallel`: how many ranks
    split each expert (None: tensor parallelism's size, Megatron's default)."""
    if moe is None:
        if expert_parallel != 1:
            raise ValueError(f"expert_parallel={expert_parallel} needs a mixture-of-experts model")
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=list(moe.layer_pattern),
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.pre_softmax,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_router_enable_expert_bias=moe.expert_bias,
        # The correction bias is architecture here (trained by the pre-training run's balancing rule): RL keeps it
        # as it is, so the engines route exactly as the trainer does. Megatron's aux-loss-free update would move it.
        moe_router_bias_update_rate=0.0,
        moe_router_dtype="fp32",  # HF computes router logits in fp32
        moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size,
        # No load-balancing loss: the forward pass then equals HF's exactly, and RL fine-tuning of a trained router
        # does not need one. Switch it on here (type "aux_loss" + a coefficient) if routing collapses.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        # The dispatcher made for expert parallelism; at EP=1 it only permutes locally.
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,  # grouped GEMM needs Transformer Engine / CUDA kernels
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
    )
