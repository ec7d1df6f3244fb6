"""DeepSeek multi-latent attention (MLA) read from config.json, and the Megatron-Core MLATransformerConfig fields
that reproduce it (the name map is in `mla`)."""

from __future__ import annotations

from dataclasses import dataclass

from slimish.megatron_bridge.errors import UnsupportedConfig


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


def mla_from_hf(cfg: dict) -> MLA:
    """DeepSeek-V3's attention."""
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


def megatron_fields(mla: MLA) -> dict:
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
