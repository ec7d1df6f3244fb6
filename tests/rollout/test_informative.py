"""Dynamic sampling's test of a group: it carries a GRPO signal when at least two samples have rewards and those
differ (the scheduler's replacement of the others runs against a real engine in
tests/e2e/test_scheduler_engine.py)."""

from __future__ import annotations

from slimish.rollout.scheduler import informative
from slimish.sample import Sample, Status


def scored(reward: float, status: Status = Status.COMPLETED) -> Sample:
    return Sample(group_id=0, index=0, prompt="p", prompt_ids=[1], response_ids=[2], rollout_logprobs=[0.0],
                  weight_versions=[0], loss_mask=[1], status=status, reward=reward)


def test_a_group_is_informative_when_its_scored_rewards_differ():
    assert informative([scored(0.0), scored(1.0), scored(1.0)])
    assert not informative([scored(1.0), scored(1.0)])
    assert not informative([scored(1.0), scored(0.0, Status.FAILED)]), "a failed sample has no reward"
    assert not informative([scored(1.0)])
