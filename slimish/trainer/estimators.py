"""Advantage estimators, keyed by `trainer.loss.advantage_estimator`.

Each entry says what it needs and how its loss is taken; `advantages` turns a step's rewards (every rank has all of
them) and this rank's per-token logprobs into per-token advantages for this rank's samples. Statistics over the whole
step's tokens are all-reduced over the data-parallel ranks (`StepInputs.dp_sum`), so every rank normalises alike.
Adding an estimator is one function and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimish.trainer import losses


@dataclass(kw_only=True)
class StepInputs:
    rewards: torch.Tensor          # [N] every sample of the step (0 where not scored)
    scored: torch.Tensor           # [N] bool: has a reward that counts in its group's baseline
    group_size: int
    indices: list[int]             # this rank's samples (step indices)
    masks: list[torch.Tensor]      # per local sample: [T_i] train mask of its response
    old: list[torch.Tensor]        # per local sample: [T_i] the trainer's logprobs before the step
    ref: list[torch.Tensor] | None  # per local sample: [T_i] reference logprobs (when the estimator needs them)
    values: list[torch.Tensor] | None = None  # per local sample: [T_i] the critic's values (ppo)
    dp_sum: Callable[[torch.Tensor], torch.Tensor]  # sum over the data-parallel ranks (identity at DP 1)


@dataclass(frozen=True, kw_only=True)
class Estimator:
    advantages: Callable[[StepInputs, object], list[torch.Tensor]]  # (inputs, TrainerConfig) -> per sample [T_i]
    ratio_level: str = "token"         # "sequence": GSPO's sequence-level ratio and clipping
    aggregation: str | None = None     # overrides trainer.loss.token_aggregation (None: keep it)
    needs_ref: Callable[[object], bool] = lambda trainer_cfg: False  # (TrainerConfig)
    needs_values: bool = False         # a critic (trainer.critic) gives per-token values
    # A critic's regression targets, per local sample [T_i] (None: no critic). Called with (inputs, TrainerConfig).
    returns: Callable[[StepInputs, object], list[torch.Tensor]] | None = None


def _per_sample(values: torch.Tensor, inputs: StepInputs) -> list[torch.Tensor]:
    """A per-sample value of the whole step, spread over each local sample's response tokens."""
    return [torch.full_like(mask, float(values[i]), dtype=torch.float32) for i, mask in zip(inputs.indices,
                                                                                          inputs.masks)]


def grpo(inputs: StepInputs, cfg) -> list[torch.Tensor]:
    return _per_sample(losses.grpo_advantages(inputs.rewards, inputs.group_size, valid=inputs.scored,
                                              normalize_std=cfg.loss.normalize_advantage_std), inputs)


def dr_grpo(inputs: StepInputs, cfg) -> list[torch.Tensor]:
    """Dr. GRPO: group-centred rewards, no division by the group's std (its loss uses a constant normaliser)."""
    return _per_sample(losses.grpo_advantages(inputs.rewards, inputs.group_size, valid=inputs.scored,
                                              normalize_std=False), inputs)


def rloo(inputs: StepInputs, cfg) -> list[torch.Tensor]:
    return _per_sample(losses.rloo_advantages(inputs.rewards, inputs.group_size, valid=inputs.scored), inputs)


def _whiten(per_sample: list[torch.Tensor], inputs: StepInputs, eps: float = 1e-6) -> list[torch.Tensor]:
    """(x - mean) / std over every trained token of the step (all data-parallel ranks)."""
    sums = inputs.rewards.new_zeros(3, dtype=torch.float64)
    for values, mask in zip(per_sample, inputs.masks):
        m = mask.double()
        sums += torch.stack([(values.double() * m).sum(), (values.double().square() * m).sum(), m.sum()])
    total, square, count = inputs.dp_sum(sums).tolist()
    mean = total / max(count, 1)
    std = max(square / max(count, 1) - mean * mean, 0.0) ** 0.5
    return [((values - mean) / (std + eps)) * (mask > 0) for values, mask in zip(per_sample, inputs.masks)]


def _reinforce_plus_plus(inputs: StepInputs, cfg, rewards: torch.Tensor) -> list[torch.Tensor]:
    returns = []
    for k, (i, mask) in enumerate(zip(inputs.indices, inputs.masks)):
        if not bool(inputs.scored[i]) or not mask.any():
            returns.append(torch.zeros_like(mask, dtype=torch.float32))
            continue
        kl = (inputs.old[k] - inputs.ref[k]) * (mask > 0) if inputs.ref is not None else torch.zeros_like(mask)
        returns.append(losses.kl_shaped_returns(float(rewards[i]), kl.float(), cfg.loss.reward_kl_coef, mask))
    return _whiten(returns, inputs)


def reinforce_plus_plus(inputs: StepInputs, cfg) -> list[torch.Tensor]:
    """REINFORCE++: token returns of the sequence reward shaped by a per-token KL to the reference
    (trainer.loss.reward_kl_coef), whitened over the step's trained tokens. No group baseline."""
    return _reinforce_plus_plus(inputs, cfg, inputs.rewards)


def reinforce_plus_plus_baseline(inputs: StepInputs, cfg) -> list[torch.Tensor]:
    """REINFORCE++ with a baseline: the group's mean reward is subtracted first, then the same shaping and
    whitening."""
    centred = losses.grpo_advantages(inputs.rewards, inputs.group_size, valid=inputs.scored, normalize_std=False)
    return _reinforce_plus_plus(inputs, cfg, centred)


def _token_rewards(inputs: StepInputs, k: int, i: int, coef: float) -> torch.Tensor:
    """Sample k's (step index i) per-token rewards: -coef x KL(old, ref) on the model's own tokens (mask > 0), 0 on
    environment tokens, and the outcome reward on the last model token (a response may end on a tool result)."""
    mask = inputs.masks[k] > 0
    kl = (inputs.old[k] - inputs.ref[k]) if inputs.ref is not None else torch.zeros_like(inputs.masks[k])
    rewards = torch.where(mask, -coef * kl.double(), 0.0)
    rewards[losses.last_true(mask)] += inputs.rewards[i].to(rewards)
    return rewards


def discounted_reverse_cumsum(x: torch.Tensor, discount: float, *, block: int = 256) -> torch.Tensor:
    """out[t] = sum_{j >= t} discount^(j - t) x[j] over a 1-D `x`, with one triangular matmul per `block` positions
    (back to front, each block carrying the one after it) instead of a step per position: a 32k-token response is
    128 small matmuls and no host sync. Within a block the powers of `discount` are <= 1, so nothing under- or
    overflows however long the response."""
    size = min(block, x.shape[0])
    offsets = torch.arange(size, device=x.device)
    lag = offsets[None, :] - offsets[:, None]  # j - t
    weights = torch.where(lag >= 0, torch.pow(discount, lag.clamp(min=0).to(x.dtype)), 0.0)
    out = torch.empty_like(x)
    carry = x.new_zeros(())
    for end in range(x.shape[0], 0, -size):
        start = max(end - size, 0)
        n = end - start
        # out[t] = sum over the block of discount^(j - t) x[j] + discount^(end - t) out[end]
        tail = torch.pow(discount, (n - offsets[:n]).to(x.dtype))
        out[start:end] = weights[:n, :n] @ x[start:end] + tail * carry
        carry = out[start]
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None, *, gamma: float,
        lam: float) -> torch.Tensor:
    """Generalised advantage estimation over one response's model tokens ([T] rewards and values, `mask` [T] > 0 on
    the model's own tokens; None: all of them): A_t = sum_k (gamma lam)^k delta_{t+k},
    delta_t = r_t + gamma V_next(t) - V_t, where next(t) is the next *model* token (the value after the last is 0).

    Environment tokens (tool results inside a multi-turn response) are not steps of the policy: the recursion skips
    them, so the value and the running advantage carry across an environment span unchanged and the last model token
    before a tool result bootstraps from the value of the first model token after it. Their advantage is 0 (they are
    not trained). Float64."""
    model = torch.ones_like(rewards, dtype=torch.bool) if mask is None else mask > 0
    r, v = rewards.double()[model], values.double()[model]
    next_values = torch.cat([v[1:], v.new_zeros(1)])
    out = torch.zeros_like(rewards, dtype=torch.float64)
    out[model] = discounted_reverse_cumsum(r + gamma * next_values - v, gamma * lam)
    return out


def _gae_per_sample(inputs: StepInputs, cfg) -> list[torch.Tensor]:
    critic, coef = cfg.critic, cfg.loss.reward_kl_coef
    out = []
    for k, (i, mask) in enumerate(zip(inputs.indices, inputs.masks)):
        if not bool(inputs.scored[i]) or not mask.any():
            out.append(torch.zeros_like(mask, dtype=torch.float64))
            continue
        out.append(gae(_token_rewards(inputs, k, i, coef), inputs.values[k], mask, gamma=critic.gamma,
                       lam=critic.lam))
    return out


def ppo(inputs: StepInputs, cfg) -> list[torch.Tensor]:
    """PPO: GAE over the critic's values of the KL-shaped token rewards, whitened over the step's trained tokens."""
    return [a.float() for a in _whiten(_gae_per_sample(inputs, cfg), inputs)]


def ppo_returns(inputs: StepInputs, cfg) -> list[torch.Tensor]:
    """The critic's targets: GAE advantages (not whitened) + the values they were computed from (on environment
    tokens, whose advantage is 0, the value itself: no target, and the critic's loss skips them anyway)."""
    return [(a + v.double()).float() for a, v in zip(_gae_per_sample(inputs, cfg), inputs.values)]


def _reward_kl(cfg) -> bool:
    return cfg.loss.reward_kl_coef > 0


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(advantages=grpo),
    "dr_grpo": Estimator(advantages=dr_grpo, aggregation="constant"),
    "rloo": Estimator(advantages=rloo),
    "reinforce_plus_plus": Estimator(advantages=reinforce_plus_plus, needs_ref=_reward_kl),
    "reinforce_plus_plus_baseline": Estimator(advantages=reinforce_plus_plus_baseline, needs_ref=_reward_kl),
    "gspo": Estimator(advantages=grpo, ratio_level="sequence", aggregation="seq_mean"),
    "ppo": Estimator(advantages=ppo, returns=ppo_returns, needs_ref=_reward_kl, needs_values=True),
}
