"""Advantages and policy losses (pure torch; no Megatron import).

Shapes: per-token tensors are [B, T] over response positions, `mask` is 1 where a token is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool, eps: float = 1e-6,
                    valid: torch.Tensor | None = None):
    """Group-normalised advantages: (r - mean_group) [/ (std_group + eps)]. `rewards` is [num_groups*group_size].

    `valid` (bool, same shape) leaves samples out: the group statistics are taken over its valid samples only, and
    an invalid sample's advantage is 0 (a group with fewer than two valid samples has no baseline: all 0)."""
    grouped = rewards.view(-1, group_size).double()
    mask = torch.ones_like(grouped) if valid is None else valid.view(-1, group_size).double()
    count = mask.sum(dim=1, keepdim=True)
    mean = (grouped * mask).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = (grouped - mean) * mask
    if normalize_std:
        std = (centred.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    centred = torch.where(count >= 2, centred, torch.zeros_like(centred))
    return centred.reshape(-1).to(rewards.dtype)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimates (Schulman's k1/k2/k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: 'k1', 'k2', 'k3'")


def rloo_advantages(rewards: torch.Tensor, group_size: int, *, valid: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i minus the mean reward of the other valid samples of its group. Invalid samples,
    and groups with fewer than two valid samples, get 0."""
    grouped = rewards.view(-1, group_size).double()
    mask = torch.ones_like(grouped) if valid is None else valid.view(-1, group_size).double()
    count = mask.sum(dim=1, keepdim=True)
    total = (grouped * mask).sum(dim=1, keepdim=True)
    others = (total - grouped) / (count - 1).clamp(min=1)
    out = torch.where(count >= 2, (grouped - others) * mask, torch.zeros_like(grouped))
    return out.reshape(-1).to(rewards.dtype)


def kl_shaped_returns(reward: float, kl: torch.Tensor, coef: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ token returns of one response (gamma 1): each token's reward is -coef * kl_t, and the sequence
    reward goes to the last model token (`mask` [T] > 0 on the model's own tokens; None: every token), not to a tool
    result the response may end on; the return at t sums the rewards from t on. `kl` is [T], 0 on environment
    tokens; returns [T]."""
    rewards = -coef * kl.double()
    rewards[last_true(torch.ones_like(kl, dtype=torch.bool) if mask is None else mask > 0)] += reward
    return rewards.flip(0).cumsum(0).flip(0).to(kl.dtype)


def last_true(mask: torch.Tensor) -> torch.Tensor:
    """The index of the last True of a 1-D bool mask that has one (a 1-element tensor on the mask's device: indexing
    with it needs no host sync)."""
    positions = torch.arange(mask.shape[0], device=mask.device)
    return torch.where(mask, positions, -1).amax(dim=0, keepdim=True)


def segment_sum(values: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Each position's segment total: out[p] = sum of values[q] over q with segments[q] == segments[p]; 0 where
    segments[p] < 0 (no segment). Differentiable in `values`. `segments` holds ids 0..n-1 (a sample per id)."""
    flat, ids = values.reshape(-1), segments.reshape(-1)
    inside = ids >= 0
    count = int(ids.max()) + 1 if inside.any() else 0
    totals = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, ids[inside], flat[inside])
    return torch.where(segments >= 0, totals[segments.clamp(min=0)], torch.zeros_like(values))


def row_segments(mask: torch.Tensor) -> torch.Tensor:
    """Segment ids for unpacked rows: row i is sample i."""
    return torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)


@dataclass(kw_only=True)
class PolicyLoss:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]  # each aggregated like the loss (same weights, same denominator): additive


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: str, denom: float | None = None) -> torch.Tensor:
    """Sum of masked values divided by `denom` (token_mean: token count; seq_mean: averaged per sequence)."""
    if how == "token_mean":
        return (values * mask).sum() / (denom if denom is not None else mask.sum().clamp(min=1))
    if how == "seq_mean":
        per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / (denom if denom is not None else per_seq.numel())
    raise ValueError(f"unknown aggregation {how!r}; allowed: 'token_mean', 'seq_mean'")


def behaviour_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                      segments: torch.Tensor, *, level: str, tis_cap: float, mis_band: tuple[float, float]):
    """Off-policy corrections for tokens the engines sampled (older weights, other numerics): the behaviour ratio
    pi_old / pi_rollout per token, or per sequence (the product over its trained tokens). Truncated importance
    sampling (tis_cap > 0) weights each token by min(ratio, tis_cap); masked importance sampling (mis_band (lo, hi),
    hi > 0) drops tokens whose ratio leaves [lo, hi], a whole sequence at sequence level. Returns (weights [B, T],
    kept [B, T] 0/1, capped [B, T] 0/1), all constants."""
    with torch.no_grad():
        log_ratio = old_logprobs - rollout_logprobs
        if level == "sequence":
            log_ratio = segment_sum(log_ratio * (mask > 0), segments)
        elif level != "token":
            raise ValueError(f"unknown importance-sampling level {level!r}; allowed: 'token', 'sequence'")
        ratio = torch.exp(log_ratio)
        weights, capped = torch.ones_like(ratio), torch.zeros_like(ratio)
        if tis_cap > 0:
            capped = (ratio > tis_cap).to(ratio.dtype)
            weights = ratio.clamp(max=tis_cap)
        low, high = mis_band
        kept = torch.ones_like(ratio)
        if high > 0:
            kept = ((ratio >= low) & (ratio <= high)).to(ratio.dtype)
        return weights, kept, capped


@dataclass(frozen=True, kw_only=True)
class PolicyLossTerms:
    """The policy loss's settings (trainer.loss, and the estimator's ratio level): clipping, the KL-to-reference
    term, the behaviour corrections (TIS cap, MIS band, at token or sequence level), the aggregation."""
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    aggregation: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    tis_cap: float = 0.0
    mis_band: tuple[float, float] = (0.0, 0.0)
    is_level: str = "token"
    ratio_level: str = "token"

    @classmethod
    def of(cls, loss_cfg, *, ratio_level: str = "token") -> PolicyLossTerms:
        """From trainer.loss (`slimish.config.schema.LossConfig`); the aggregation stays token_mean, over weights and a
        denominator the step makes (seq_mean and constant are weightings of it)."""
        return cls(clip_eps_low=loss_cfg.clip_eps_low, clip_eps_high=loss_cfg.clip_eps_high,
                   kl_coef=loss_cfg.kl_coef, kl_estimator=loss_cfg.kl_estimator, tis_cap=loss_cfg.tis_cap,
                   mis_band=(loss_cfg.mis_low, loss_cfg.mis_high), is_level=loss_cfg.is_level,
                   ratio_level=ratio_level)


def policy_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    terms: PolicyLossTerms = PolicyLossTerms(),
    denom: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> PolicyLoss:
    """Clipped-ratio policy loss (PPO / GRPO; GSPO with ratio_level="sequence") with an optional KL-to-reference
    term and off-policy corrections.

    `advantages` is [B] (one per row) or [B, T]; `terms` the loss's settings. `mask` weights each token in the
    aggregation (0 = not trained).
    `denom` lets micro-batches share the normaliser of the whole minibatch, so the summed micro-batch losses equal
    the minibatch loss. `segments` ([B, T] sample ids, -1 outside any response; default: one sample per row) says
    which tokens form one sequence, for sequence-level ratios and corrections in packed rows.

    terms.ratio_level "sequence" (GSPO, token form): every token of a sequence takes the sequence's ratio
    exp(mean over its trained tokens of log pi - log pi_old), clipped as a whole, with the gradient of
    log pi of the token, scaled by that ratio: with seq_mean aggregation it is GSPO's sequence objective.

    The PPO ratio is taken against the trainer's `old_logprobs`; `rollout_logprobs` (what the engines reported)
    feed the behaviour corrections (`behaviour_weights`), constants that scale or drop each token's
    policy-gradient term.
    """
    clip_eps_low, clip_eps_high, aggregation = terms.clip_eps_low, terms.clip_eps_high, terms.aggregation
    tis_cap, mis_band, ratio_level = terms.tis_cap, terms.mis_band, terms.ratio_level
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    if segments is None:
        segments = row_segments(mask)
    log_ratio = logprobs - old_logprobs
    if ratio_level == "sequence":
        trained = (mask > 0).to(logprobs.dtype)
        sequence_mean = segment_sum(log_ratio * trained, segments) / segment_sum(trained, segments).clamp(min=1)
        log_ratio = sequence_mean.detach() + logprobs - logprobs.detach()
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio level {ratio_level!r}; allowed: 'token', 'sequence'")
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    weights = kept = capped = torch.ones_like(logprobs)
    if tis_cap > 0 or mis_band[1] > 0:
        if rollout_logprobs is None:
            raise ValueError("tis_cap > 0 or a mis_band needs rollout_logprobs")
        weights, kept, capped = behaviour_weights(old_logprobs, rollout_logprobs, mask, segments, level=terms.is_level,
                                                  tis_cap=tis_cap, mis_band=mis_band)
        per_token = per_token * weights * kept
    else:
        capped = torch.zeros_like(logprobs)
    metrics = {}
    if ref_logprobs is not None and terms.kl_coef > 0:
        kl_tokens = kl_penalty(logprobs, ref_logprobs, terms.kl_estimator)
        per_token = per_token + terms.kl_coef * kl_tokens
        metrics["kl_ref"] = aggregate(kl_tokens.detach(), mask, aggregation, denom)
    else:
        metrics["kl_ref"] = logprobs.new_zeros(())
    loss = aggregate(per_token, mask, aggregation, denom)
    with torch.no_grad():
        metrics.update(
            pg_loss=loss.detach(),
            ppo_kl=aggregate(old_logprobs - logprobs, mask, aggregation, denom),
            clip_frac=aggregate((clipped > unclipped).to(logprobs.dtype), mask, aggregation, denom),
            tis_weight=aggregate(weights, mask, aggregation, denom),
            tis_capped_frac=aggregate(capped, mask, aggregation, denom),
            mis_masked_frac=aggregate(1 - kept, mask, aggregation, denom))
    return PolicyLoss(loss=loss, metrics=metrics)
