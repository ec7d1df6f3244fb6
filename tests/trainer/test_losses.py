"""GRPO advantages and the clipped policy loss (pure torch)."""

import torch

from slimish.trainer.losses import PolicyLossTerms, grpo_advantages, kl_penalty, policy_loss


def test_grpo_advantages_are_group_normalised():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    adv = grpo_advantages(rewards, 4, normalize_std=True)
    assert adv[:4].sum().abs() < 1e-6 and adv[0] > 0 > adv[1]
    assert torch.all(adv[4:] == 0), "a group with equal rewards carries no signal"
    centred = grpo_advantages(rewards, 4, normalize_std=False)
    assert torch.allclose(centred[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_invalid_samples_neither_train_nor_shift_the_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    valid = torch.tensor([True, True, False, True, True, False, False, False])
    adv = grpo_advantages(rewards, 4, normalize_std=False, valid=valid)
    assert torch.allclose(adv[:4], torch.tensor([2 / 3, -1 / 3, 0.0, -1 / 3]))  # mean over the 3 valid samples
    assert torch.all(adv[4:] == 0), "one valid sample: no baseline, no signal"
    full = grpo_advantages(rewards, 4, normalize_std=True, valid=torch.ones(8, dtype=torch.bool))
    assert torch.allclose(full, grpo_advantages(rewards, 4, normalize_std=True), atol=1e-6)


def test_truncated_importance_weights_correct_for_the_behaviour_policy():
    old = torch.zeros(1, 3)
    rollout = torch.log(torch.tensor([[0.5, 2.0, 0.1]]))  # pi_old / pi_rollout = 2, 0.5, 10
    lp = torch.zeros(1, 3, requires_grad=True)
    out = policy_loss(logprobs=lp, old_logprobs=old, advantages=torch.ones(1), mask=torch.ones(1, 3),
                      terms=PolicyLossTerms(tis_cap=3.0), rollout_logprobs=rollout)
    out.loss.backward()
    assert torch.allclose(lp.grad, -torch.tensor([[2.0, 0.5, 3.0]]) / 3)  # weights capped at 3, no gradient
    assert torch.isclose(out.metrics["tis_weight"], torch.tensor(5.5 / 3))


def test_on_policy_ratio_gives_zero_kl_and_no_clipping():
    lp = torch.randn(4, 6)
    mask = torch.ones(4, 6)
    out = policy_loss(logprobs=lp, old_logprobs=lp.clone(), advantages=torch.randn(4), mask=mask)
    assert out.metrics["ppo_kl"].item() == 0.0 and out.metrics["clip_frac"].item() == 0.0


def test_clipping_stops_the_gradient_beyond_the_trust_region():
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), 0.5, requires_grad=True)  # ratio e^0.5 > 1.2
    out = policy_loss(logprobs=new, old_logprobs=old, advantages=torch.ones(1), mask=torch.ones(1, 1))
    out.loss.backward()
    assert new.grad.item() == 0.0 and out.metrics["clip_frac"].item() == 1.0


def test_mask_and_shared_denominator():
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    out = policy_loss(logprobs=lp, old_logprobs=torch.zeros(2, 3), advantages=torch.tensor([1.0, -1.0]),
                      mask=mask, denom=4.0)
    assert out.loss.item() == -0.5  # two tokens with advantage 1 over a shared denominator of 4
    out.loss.backward()
    assert lp.grad[1].abs().sum() == 0 and lp.grad[0, 2] == 0


def test_k3_kl_is_nonnegative_and_zero_at_equality():
    a, b = torch.randn(100), torch.randn(100)
    assert torch.all(kl_penalty(a, b, "k3") >= -1e-7)
    assert torch.all(kl_penalty(a, a, "k3") == 0)
