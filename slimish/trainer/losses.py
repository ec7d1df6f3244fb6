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


@dataclass(kw_only=True)
class PolicyLossStats:
    loss: torch.Tensor
    ppo_kl: torch.Tensor
    clip_frac: torch.Tensor
    kl_ref: torch.Tensor
    tis_weight: torch.Tensor  # mean truncated importance weight (1 when TIS is off)


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: str, denom: float | None = None) -> torch.Tensor:
    """Sum of masked values divided by `denom` (token_mean: token count; seq_mean: averaged per sequence)."""
    if how == "token_mean":
        return (values * mask).sum() / (denom if denom is not None else mask.sum().clamp(min=1))
    if how == "seq_mean":
        per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / (denom if denom is not None else per_seq.numel())
    raise ValueError(f"unknown aggregation {how!r}; allowed: 'token_mean', 'seq_mean'")


def policy_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    aggregation: str,
    denom: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float = 0.0,
) -> PolicyLossStats:
    """Clipped-ratio PPO/GRPO loss with an optional KL-to-reference term.

    `advantages` is [B] (one per sequence) or [B, T]. `denom` lets micro-batches share the normaliser of the whole
    minibatch, so the summed micro-batch losses equal the minibatch loss.

    Truncated importance sampling (`tis_cap` > 0): the tokens were sampled by the engines (`rollout_logprobs`),
    possibly with older weights (partial rollouts) and always with other numerics; the PPO ratio is taken against
    the trainer's `old_logprobs`, and each token's policy-gradient term is weighted by the behaviour correction
    min(exp(old_logprobs - rollout_logprobs), tis_cap), a constant (no gradient).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    tis = torch.ones_like(logprobs)
    if tis_cap > 0:
        if rollout_logprobs is None:
            raise ValueError("tis_cap > 0 needs rollout_logprobs")
        tis = torch.exp(old_logprobs - rollout_logprobs).clamp(max=tis_cap).detach()
        per_token = per_token * tis
    kl_ref = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None and kl_coef > 0:
        kl_tokens = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        per_token = per_token + kl_coef * kl_tokens
        kl_ref = aggregate(kl_tokens.detach(), mask, aggregation, denom)
    with torch.no_grad():
        ppo_kl = aggregate(-log_ratio, mask, aggregation, denom)
        clip_frac = aggregate((clipped > unclipped).to(logprobs.dtype), mask, aggregation, denom)
        tis_weight = aggregate(tis, mask, aggregation, denom)
    return PolicyLossStats(loss=aggregate(per_token, mask, aggregation, denom), ppo_kl=ppo_kl,
                           clip_frac=clip_frac, kl_ref=kl_ref, tis_weight=tis_weight)
