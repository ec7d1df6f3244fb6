"""rollout.overlong: truncated responses trained as they are, kept out of the loss (their rewards still in their
group's baseline), or every response given DAPO's soft length penalty; and the step's length metrics."""

from __future__ import annotations

import pytest
import torch

from slimish.config.schema import OverlongConfig
from slimish.rollout import overlong
from slimish.sample import Sample, Status
from slimish.trainer import estimators
from tests.kit import samples as kit


def sample(length: int, status: Status, reward: float = 1.0, error: str = "", group_id: int = 0) -> Sample:
    return kit.sample(response_ids=[5] * length, group_id=group_id, status=status, reward=reward, error=error)


def test_dapo_length_penalty_falls_from_zero_to_minus_one_over_the_buffer():
    penalty = [overlong.length_penalty(n, max_tokens=16, buffer_tokens=4) for n in (1, 12, 13, 14, 16)]
    assert penalty == [0.0, 0.0, -0.25, -0.5, -1.0]


def test_train_changes_nothing():
    samples = [sample(16, Status.TRUNCATED), sample(3, Status.COMPLETED)]
    overlong.apply(samples, OverlongConfig(mode="train"), max_tokens=16)
    assert all(s.trainable for s in samples) and [s.reward for s in samples] == [1.0, 1.0]


def test_filter_keeps_truncated_responses_out_of_the_loss_only():
    truncated, complete, failed = sample(16, Status.TRUNCATED), sample(3, Status.COMPLETED), sample(2, Status.FAILED)
    overlong.apply([truncated, complete, failed], OverlongConfig(mode="filter"), max_tokens=16)
    assert truncated.scored and not truncated.trainable and truncated.train_mask == [0] * 16
    assert truncated.excluded == overlong.FILTERED and truncated.reward == 1.0
    assert complete.trainable and not failed.excluded


def test_penalty_is_added_by_length_and_spares_failed_rewards():
    cfg = OverlongConfig(mode="penalty", buffer_tokens=4, penalty_factor=0.5)
    long, short, reward_failed = sample(14, Status.COMPLETED), sample(3, Status.COMPLETED), \
        sample(16, Status.TRUNCATED, reward=0.0, error="reward failed: ValueError: x")
    overlong.apply([long, short, reward_failed], cfg, max_tokens=16)
    assert long.reward == pytest.approx(1.0 - 0.25) and long.meta["length_penalty"] == pytest.approx(-0.25)
    assert short.reward == 1.0 and reward_failed.reward == 0.0
    assert all(s.trainable for s in (long, short, reward_failed))


def test_a_filtered_response_still_counts_in_its_groups_baseline():
    """Group of 2: the truncated response's reward 0 is in the mean, so the complete one's advantage is 0.5."""
    group = [sample(3, Status.COMPLETED, reward=1.0), sample(16, Status.TRUNCATED, reward=0.0)]
    overlong.apply(group, OverlongConfig(mode="filter"), max_tokens=16)
    inputs = estimators.StepInputs(
        rewards=torch.tensor([s.reward for s in group]), scored=torch.tensor([s.scored for s in group]),
        group_size=2, indices=[0, 1], masks=[torch.tensor(s.train_mask, dtype=torch.float32) for s in group],
        old=[], ref=None, dp_sum=lambda t: t)
    advantages = estimators.dr_grpo(inputs, None)  # group-centred: (1 - 0.5)
    assert advantages[0][0] == pytest.approx(0.5) and not group[1].trainable


def test_length_metrics():
    samples = [sample(n, Status.COMPLETED) for n in (1, 2, 3, 4)] + [sample(16, Status.TRUNCATED),
                                                                    sample(9, Status.FAILED)]
    overlong.apply(samples, OverlongConfig(mode="filter"), max_tokens=16)
    metrics = overlong.metrics(samples)
    assert metrics["response_len_p50"] == 3.0 and metrics["response_len_max"] == 16
    assert metrics["response_len_p95"] == pytest.approx(16 - 0.05 * 4 * 12)  # between 4 and 16, numpy's linear
    assert metrics["truncated_frac"] == pytest.approx(1 / 5) and metrics["overlong_filtered"] == 1
    assert overlong.metrics([])["response_len_max"] == 0


def test_a_restarted_sample_is_no_longer_excluded_and_old_checkpoints_load():
    s = sample(16, Status.TRUNCATED)
    s.excluded = overlong.FILTERED
    s.restart()
    assert s.excluded == ""
    old = {k: v for k, v in sample(2, Status.COMPLETED).to_dict().items() if k != "excluded"}
    assert Sample.from_dict(old).trainable
