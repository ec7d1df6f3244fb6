"""The scheduler's rules against a stand-in engine (tests/kit/engines.py's `StandInEngine`, an httpx transport
answering /generate and the control calls at once): engines that lag the policy fail loudly instead of regenerating
forever; dynamic sampling replaces groups without reward variance, up to its bound; a rollout program's samples take
its sample's place. What needs a real engine's abort and retract is in tests/e2e/test_scheduler_engine.py."""

from __future__ import annotations

import pytest

from slimish.config.schema import DynamicSamplingConfig
from slimish.rollout.scheduler import informative
from slimish.sample import Sample, Status
from tests.kit.engines import StandInEngine
from tests.rollout.scheduler_kit import GROUP, make_scheduler

URL = "http://engine"


def stand_in_scheduler(mode: str, engine: StandInEngine | None = None, **kwargs):
    return make_scheduler(URL, mode, transport=(engine or StandInEngine()).transport(), **kwargs)


@pytest.mark.parametrize("synced_to", [0, 5])
def test_engines_behind_the_policy_fail_loudly(synced_to):
    """The engine serves version 0. Told so, a policy at version 5 is too far ahead of it; told it was synced to
    version 5, it answers with version-0 tokens: either way regenerating cannot help."""
    scheduler = stand_in_scheduler("abort", max_staleness=1)
    try:
        scheduler.resume(policy_version=synced_to)
        with pytest.raises(RuntimeError, match="do not serve the trained weights"):
            scheduler.collect(policy_version=5)
    finally:
        scheduler.close()


@pytest.mark.parametrize("control_status", [200, 500])
def test_retract_mode_pauses_and_continues_every_engine(control_status, caplog):
    """Around a weight sync in retract mode the scheduler pauses the engines with retraction and lets them continue
    (the engine client names the endpoints); an engine that fails is logged and skipped, never raised."""
    engine = StandInEngine(control_status=control_status)
    scheduler = stand_in_scheduler("retract", engine)
    try:
        scheduler.pause()
        scheduler.resume(policy_version=1)
    finally:
        scheduler.close()
    assert engine.control == [("/pause_generation", {"mode": "retract"}), ("/continue_generation", {})]
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failed == ([] if control_status == 200 else [f"{URL}: pause failed: RuntimeError: HTTP 500: "
                                                       '{"success":false}',
                                                       f"{URL}: continue failed: RuntimeError: HTTP 500: "
                                                       '{"success":false}'])


def reward_varies_in_odd_groups(samples: list[Sample]) -> int:
    """Even group ids: every sample 1.0 (no variance); odd: the sample's index (always varies)."""
    for sample in samples:
        sample.reward = 1.0 if sample.group_id % 2 == 0 else float(sample.index)
    return 0


def one_dynamic_step(score, *, max_extra_groups: int) -> tuple[list[Sample], dict]:
    """One step's samples and counters from a mode-off scheduler of 4 groups with dynamic sampling."""
    scheduler = stand_in_scheduler("off", over_sampling=0, score=score,
                                   dynamic_sampling=DynamicSamplingConfig(enabled=True,
                                                                          max_extra_groups=max_extra_groups))
    try:
        return scheduler.collect(policy_version=0)
    finally:
        scheduler.close()


def test_dynamic_sampling_replaces_groups_without_reward_variance():
    """Groups 0-3 start; each dropped even group frees a place for the next id, so the step's four odd groups
    (1, 3, 5, 7) are complete only after groups 0, 2, 4 and 6 were dropped."""
    samples, counters = one_dynamic_step(reward_varies_in_odd_groups, max_extra_groups=64)
    groups = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    assert sorted(groups) == [1, 3, 5, 7] and all(informative(g) for g in groups.values())
    assert counters["groups_dropped_uninformative"] == 4 and counters.get("groups_kept_uninformative", 0) == 0


def test_dynamic_sampling_keeps_uninformative_groups_past_its_bound():
    def no_variance(samples: list[Sample]) -> int:
        for sample in samples:
            sample.reward = 1.0
        return 0

    samples, counters = one_dynamic_step(no_variance, max_extra_groups=1)
    assert len({s.group_id for s in samples}) == 4
    assert counters["groups_dropped_uninformative"] == 1 and counters["groups_kept_uninformative"] == 4


async def twins_but_index_1_fails(sample: Sample, client) -> list[Sample]:
    """A rollout program that returns two samples in each one's place, and raises on index 1."""
    if sample.index == 1:
        raise ValueError("the environment broke")
    await client.generate(sample)
    if client.remaining(sample) >= 2:
        client.append_environment(sample, "9 9")
    return [sample, Sample.from_dict(sample.to_dict())]


def test_a_rollout_programs_samples_take_the_place_of_its_sample():
    """What a program returns replaces its sample in the group (renumbered); a program that raises fails its sample
    (counted), and the group trains without it."""
    scheduler = stand_in_scheduler("off", over_sampling=0, program=twins_but_index_1_fails,
                                   score=lambda samples: 0)
    try:
        samples, counters = scheduler.collect(policy_version=0)
    finally:
        scheduler.close()
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    assert len(groups) == 4 and counters["program_errors"] == 4
    for group in groups.values():
        assert sorted(s.index for s in group) == list(range(2 * GROUP - 1)), "3 twins and the failed one, renumbered"
        failed = [s for s in group if s.status is Status.FAILED]
        assert len(failed) == 1 and "the environment broke" in failed[0].error
        for sample in group:
            if sample.status is not Status.FAILED:
                sample.check()
                assert sample.meta["program"] and sample.response == " ".join(map(str, sample.response_ids))
