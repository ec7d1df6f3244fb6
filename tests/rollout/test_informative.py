"""Dynamic sampling's test of a group: it carries a GRPO signal when at least two samples have rewards and those
differ (the scheduler's replacement of the others runs against a real engine in
tests/e2e/test_scheduler_engine.py)."""

from __future__ import annotations

from slimish.rollout.scheduler import informative
from slimish.sample import Sample, Status
from tests.kit.samples import sample


def scored(reward: float, status: Status = Status.COMPLETED) -> Sample:
    return sample(response_ids=[2], status=status, reward=reward)


def test_a_group_is_informative_when_its_scored_rewards_differ():
    assert informative([scored(0.0), scored(1.0), scored(1.0)])
    assert not informative([scored(1.0), scored(1.0)])
    assert not informative([scored(1.0), scored(0.0, Status.FAILED)]), "a failed sample has no reward"
    assert not informative([scored(1.0)])
