"""Each advantage estimator and objective against a hand-computed example (pure torch), and every registry entry
through a real trainer step."""

from __future__ import annotations

import math

import pytest
import torch

from slimish.trainer import estimators, losses


def inputs(rewards, *, group_size, masks, old=None, ref=None, scored=None):
    return estimators.StepInputs(
        rewards=torch.tensor(rewards), scored=torch.tensor(scored or [True] * len(rewards)), group_size=group_size,
        indices=list(range(len(masks))), masks=[torch.tensor(m, dtype=torch.float32) for m in masks],
        old=[torch.tensor(o) for o in old] if old else [], ref=[torch.tensor(r) for r in ref] if ref else None,
        dp_sum=lambda t: t)


class Cfg:  # the TrainerConfig fields the estimators read
    class loss:  # noqa: N801
        normalize_advantage_std = True
        reward_kl_coef = 0.5

    class critic:  # noqa: N801
        gamma, lam = 1.0, 0.5


def test_grpo_dr_grpo_and_rloo_by_hand():
    step = inputs([1.0, 0.0, 0.0, 1.0], group_size=4, masks=[[1, 1]] * 4)
    std = math.sqrt(4 * 0.25 / 3)  # sample std of [1, 0, 0, 1]
    assert estimators.grpo(step, Cfg)[0].tolist() == pytest.approx([0.5 / (std + 1e-6)] * 2)
    assert [a[0].item() for a in estimators.dr_grpo(step, Cfg)] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # leave-one-out: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    assert [a[0].item() for a in estimators.rloo(step, Cfg)] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    unscored = inputs([1.0, 0.0, 0.0, 1.0], group_size=4, masks=[[1]] * 4, scored=[True, True, False, True])
    assert [a[0].item() for a in estimators.rloo(unscored, Cfg)] == pytest.approx([0.5, -1.0, 0.0, 0.5])


def test_reinforce_plus_plus_shapes_returns_with_kl_and_whitens_them():
    # Sample 0: reward 1, per-token KL (old - ref) 0.2 and 0.4: token rewards (-0.1, -0.2 + 1) -> returns (0.7, 0.8).
    # Sample 1: reward 0, KL 0 -> returns (0, 0). Whitened over the 4 tokens (population std).
    step = inputs([1.0, 0.0], group_size=2, masks=[[1, 1], [1, 1]], old=[[0.2, 0.4], [0.0, 0.0]],
                  ref=[[0.0, 0.0], [0.0, 0.0]])
    returns = torch.tensor([0.7, 0.8, 0.0, 0.0])
    expected = (returns - returns.mean()) / (returns.var(unbiased=False).sqrt() + 1e-6)
    got = torch.cat(estimators.reinforce_plus_plus(step, Cfg))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # With a baseline: rewards centred in their group first (0.5, -0.5): returns (0.2, 0.3) and (-0.5, -0.5).
    returns = torch.tensor([0.2, 0.3, -0.5, -0.5])
    expected = (returns - returns.mean()) / (returns.var(unbiased=False).sqrt() + 1e-6)
    torch.testing.assert_close(torch.cat(estimators.reinforce_plus_plus_baseline(step, Cfg)), expected, atol=1e-5,
                               rtol=0)


def test_segment_sum_totals_each_sample_of_a_packed_row():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]], requires_grad=True)
    segments = torch.tensor([[-1, 0, 0, 1, 1]])
    out = losses.segment_sum(values, segments)
    assert out.tolist() == [[0.0, 5.0, 5.0, 9.0, 9.0]]
    out.sum().backward()
    assert values.grad.tolist() == [[0.0, 2.0, 2.0, 2.0, 2.0]]


def test_gspo_takes_one_clipped_ratio_per_sequence():
    """Two sequences in one packed row; sequence 0's token log-ratios 0.1 and 0.3 give its ratio exp(0.2) for both
    tokens; clipped at 1 + 0.1 with a positive advantage: no gradient. Sequence 1 (log-ratio 0.05, inside the clip
    range) gets gradient -A * exp(0.05) / (its token count) on each token under seq_mean."""
    old = torch.zeros(1, 5)
    new = torch.tensor([[0.0, 0.1, 0.3, 0.05, 0.05]], requires_grad=True)
    segments = torch.tensor([[-1, 0, 0, 1, 1]])
    mask = torch.tensor([[0.0, 0.5, 0.5, 0.5, 0.5]])  # seq_mean weights: 1 / length per trained token
    terms = losses.PolicyLossTerms(clip_eps_low=0.1, clip_eps_high=0.1, ratio_level="sequence")
    out = losses.policy_loss(logprobs=new, old_logprobs=old, advantages=torch.ones(1, 5), mask=mask, terms=terms,
                             denom=2.0, segments=segments)
    out.loss.backward()
    assert new.grad[0, 1:3].tolist() == [0.0, 0.0]
    assert new.grad[0, 3:].tolist() == pytest.approx([-math.exp(0.05) * 0.5 / 2] * 2)
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5)  # one of the two sequences


def test_masked_importance_sampling_drops_tokens_or_whole_sequences_outside_the_band():
    old = torch.zeros(1, 4)
    rollout = torch.log(torch.tensor([[1.0, 0.25, 1.0, 1.25]]))  # behaviour ratios 1, 4, 1, 0.8
    lp = torch.zeros(1, 4, requires_grad=True)
    segments = torch.tensor([[0, 0, 1, 1]])
    common = dict(old_logprobs=old, advantages=torch.ones(1, 4), mask=torch.ones(1, 4), rollout_logprobs=rollout,
                  segments=segments)
    band = losses.PolicyLossTerms(mis_band=(0.5, 2.0))
    token = losses.policy_loss(logprobs=lp, terms=band, **common)
    token.loss.backward()
    assert lp.grad.tolist() == [[-0.25, 0.0, -0.25, -0.25]]  # token 1 (ratio 4) dropped; the normaliser stays 4
    assert token.metrics["mis_masked_frac"].item() == pytest.approx(0.25)
    lp.grad = None
    sequence = losses.policy_loss(logprobs=lp, terms=losses.PolicyLossTerms(mis_band=(0.5, 2.0), is_level="sequence"),
                                  **common)  # ratios 4 (seq 0) and 0.8 (seq 1)
    sequence.loss.backward()
    assert lp.grad.tolist() == [[0.0, 0.0, -0.25, -0.25]]
    capped = losses.policy_loss(logprobs=lp, terms=losses.PolicyLossTerms(tis_cap=2.0), **common)
    assert capped.metrics["tis_capped_frac"].item() == pytest.approx(0.25)
    assert capped.metrics["tis_weight"].item() == pytest.approx((1 + 2 + 1 + 0.8) / 4)


def test_every_estimator_has_what_the_config_accepts():
    from typing import get_args, get_type_hints

    from slimish.config.schema import ESTIMATOR_MIN_GROUP_SIZE, LossConfig

    allowed = get_args(get_type_hints(LossConfig)["advantage_estimator"])
    assert set(allowed) == set(estimators.ESTIMATORS) == set(ESTIMATOR_MIN_GROUP_SIZE)


@pytest.mark.parametrize("name", sorted(estimators.ESTIMATORS))
def test_each_estimator_takes_a_trainer_step(name, task_assets, megatron_world):
    """Advantages on the trainer from the samples' rewards, per token; the step moves the weights (grad norm > 0)
    and ppo_kl is 0 on-policy. reinforce_plus_plus and ppo shape rewards with a reference model; ppo trains its critic
    too. Packed rows and masked importance sampling on, so sequence ratios and corrections see several samples per
    row."""
    from slimish.trainer import rl_step
    from tests.kit.trainer import logprobs_by_sample, make_worker, task_overrides
    from tests.trainer.test_packed_parity import _samples

    worker = make_worker(*task_overrides(task_assets), f"trainer.loss.advantage_estimator={name}",
                         "trainer.loss.reward_kl_coef=0.1", "trainer.max_tokens_per_micro_batch=24",
                         "trainer.loss.mis_low=0.5", "trainer.loss.mis_high=2", "trainer.loss.clip_eps_low=0.01",
                         "trainer.loss.clip_eps_high=0.01")
    ctx = worker.step
    assert (ctx.reference is not None) == (name.startswith("reinforce_plus_plus") or name == "ppo")
    assert (ctx.critic is not None) == (name == "ppo")
    samples = _samples()
    for sample, reward, logprobs in zip(samples, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0],
                                        logprobs_by_sample(worker, samples)):
        sample.reward = reward
        sample.rollout_logprobs = logprobs.tolist()  # the engines sampled what the trainer holds: ratios of 1
    batch, _ = rl_step.prepare(ctx, samples)
    advantages = rl_step.advantages(ctx, batch)
    assert len(advantages) == 8 and any(a != 0 for a in advantages)
    metrics = rl_step.train(ctx, batch)
    assert metrics["ppo_kl"] == 0.0 and metrics["grad_norm"] > 0 and metrics["mis_masked_frac"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    if name == "ppo":
        assert metrics["value_loss"] > 0 and metrics["critic_grad_norm"] > 0
        batch, _ = rl_step.prepare(ctx, samples)
        rl_step.advantages(ctx, batch)
        assert rl_step.train(ctx, batch)["value_loss"] < metrics["value_loss"], "the critic learns the returns"


def test_gae_by_hand():
    """Rewards (0, 0, 1), values (0.5, 0.25, 0.5), gamma 1, lambda 0.5: deltas (-0.25, 0.25, 0.5);
    A_2 = 0.5, A_1 = 0.25 + 0.5 * 0.5 = 0.5, A_0 = -0.25 + 0.5 * 0.5 = 0."""
    got = estimators.gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.25, 0.5]), gamma=1.0, lam=0.5)
    assert got.tolist() == pytest.approx([0.0, 0.5, 0.5])
    step = inputs([1.0, 0.0], group_size=1, masks=[[1, 1, 1], [1, 1, 1]], old=[[0.0] * 3, [0.0] * 3],
                  ref=[[0.0] * 3, [0.0] * 3])
    step.values = [torch.tensor([0.5, 0.25, 0.5]), torch.zeros(3)]
    returns = estimators.ppo_returns(step, Cfg)
    assert returns[0].tolist() == pytest.approx([0.5, 0.75, 1.0]) and returns[1].tolist() == [0.0, 0.0, 0.0]
    advantages = torch.cat(estimators.ppo(step, Cfg))  # GAE (0, 0.5, 0.5, 0, 0, 0) whitened
    raw = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    torch.testing.assert_close(advantages, (raw - raw.mean()) / (raw.var(unbiased=False).sqrt() + 1e-6))


def _ppo_step(masks, values, old, rewards=(1.0,)):
    step = inputs(list(rewards), group_size=1, masks=masks, old=old, ref=[[0.0] * len(m) for m in masks])
    step.values = [torch.tensor(v) for v in values]
    return step


def test_gae_skips_two_environment_spans():
    """Mask (1, 1, 0, 0, 1, 0, 1, 1): the model's tokens are 0, 1, 4, 6, 7; values on environment tokens (9) must not
    count. Over the model tokens: rewards (0, 0, 0, 0, 1), values (0.5, 0.25, 0.5, 0.25, 0.5), gamma 1, lambda 0.5:
    deltas (-0.25, 0.25, -0.25, 0.25, 0.5); A = (-0.125, 0.25, 0, 0.5, 0.5); token 1 bootstraps from token 4's value,
    token 4 from token 6's. Environment tokens: advantage 0, return = their own value (no target)."""
    step = _ppo_step([[1, 1, 0, 0, 1, 0, 1, 1]], [[0.5, 0.25, 9, 9, 0.5, 9, 0.25, 0.5]], [[0.0] * 8])
    advantages = estimators._gae_per_sample(step, Cfg)[0]
    assert advantages.tolist() == pytest.approx([-0.125, 0.25, 0, 0, 0, 0, 0.5, 0.5])
    assert estimators.ppo_returns(step, Cfg)[0].tolist() == pytest.approx([0.375, 0.5, 9, 9, 0.5, 9, 0.75, 1.0])


def test_gae_of_a_response_ending_on_a_tool_result_rewards_the_last_model_token():
    """Mask (1, 1, 0, 0): the outcome reward sits on token 1, not on the tool result's last token; KL-shaped rewards
    are 0 on environment tokens whatever old - ref says there. Rewards over the model tokens (-0.1, -0.2 + 1), values
    (0.5, 0.25): deltas (-0.1 + 0.25 - 0.5, 0.8 - 0.25) = (-0.35, 0.55); A = (-0.35 + 0.5 * 0.55, 0.55)."""
    step = _ppo_step([[1, 1, 0, 0]], [[0.5, 0.25, 9, 9]], [[0.2, 0.4, 3.0, 3.0]])
    assert estimators._token_rewards(step, 0, 0, Cfg.loss.reward_kl_coef).tolist() == pytest.approx(
        [-0.1, 0.8, 0, 0])
    assert estimators._gae_per_sample(step, Cfg)[0].tolist() == pytest.approx([-0.075, 0.55, 0, 0])
    # REINFORCE++ likewise: returns (0.7, 0.8) on the model tokens, the reward not on the tool result
    returns = losses.kl_shaped_returns(1.0, torch.tensor([0.2, 0.4, 0.0, 0.0]), 0.5, torch.tensor([1, 1, 0, 0]))
    assert returns.tolist()[:2] == pytest.approx([0.7, 0.8])


def _masked_gae_loop(rewards, values, mask, gamma, lam):
    """An independent per-token GAE that skips masked positions by carrying the next value and the running
    advantage across them (the usual formulation of multi-turn GAE)."""
    out, running, next_value = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        if not mask[t]:
            continue
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        out[t], next_value = running, values[t]
    return out


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0), (0.5, 0.0)])
def test_vectorised_gae_equals_a_per_token_loop_over_many_blocks(gamma, lam):
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(1500, dtype=torch.float64, generator=generator)
    values = torch.randn(1500, dtype=torch.float64, generator=generator)
    mask = torch.rand(1500, generator=generator) < 0.7
    expected = _masked_gae_loop(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(estimators.gae(rewards, values, mask, gamma=gamma, lam=lam),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_value_loss_clips_around_the_old_value():
    from slimish.trainer.critic import value_loss

    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    loss, metrics = value_loss(values, torch.zeros(1, 2), torch.tensor([[2.0, 0.5]]), torch.ones(1, 2), clip=0.2,
                               denom=2.0)
    # token 0: V moved 1.0 from 0 (clipped to 0.2): max((1-2)^2, (0.2-2)^2) = 3.24 -> the clipped term, no gradient
    # token 1: V = old: both terms 0.25
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.25) / 2)
    loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, (0.0 - 0.5) / 2])
    assert metrics["value_clip_frac"].item() == pytest.approx(0.5)
