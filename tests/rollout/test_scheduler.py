"""The group scheduler against one real SGLang CPU engine (no router, no trainer): every group is handed out
exactly once across aborts, continuations and checkpoint round trips; retract pauses keep requests alive; engines
that lag the policy fail loudly instead of regenerating forever; dynamic sampling replaces groups without reward
variance, up to its bound."""

from __future__ import annotations

import json

import pytest

from slimish.config.schema import DynamicSamplingConfig, PartialRolloutConfig
from slimish.rollout.generate import SamplingParams
from slimish.rollout.scheduler import RolloutScheduler, informative
from slimish.sample import Sample, Status

pytestmark = pytest.mark.e2e

GROUP = 4
MAX_NEW_TOKENS = 200
STOP_E_T = ("e", "t")  # about one character in 18 of the untrained model's output: lengths near geometric


@pytest.fixture(scope="module")
def engine_url(task_assets, tmp_path_factory):
    from slimish.compat import sglang_cpu
    from slimish.engines.process import ManagedProcess
    from slimish.engines.server import engine_argv
    from tests.conftest import free_port

    port = free_port()
    argv = engine_argv(model_path=task_assets["model"], host="127.0.0.1", port=port, device="cpu", dtype="float32",
                       tp=1, max_total_tokens=4096, seed=0, extra=[])
    proc = ManagedProcess("engine", argv, env=sglang_cpu.server_env(),
                          log_path=tmp_path_factory.mktemp("engine") / "engine.log")
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http_ok(f"{url}/health_generate", timeout_s=600)
        yield url
    finally:
        proc.stop()


def reward_by_length(samples: list[Sample]) -> int:
    for sample in samples:
        sample.reward = float(len(sample.response_ids))
    return 0


def make_scheduler(url: str, mode: str, *, over_sampling: int = 2, max_staleness: int = 0,
                   max_concurrency: int = 64, stop: tuple[str, ...] = (), score=reward_by_length,
                   dynamic_sampling: DynamicSamplingConfig | None = None, program=None) -> RolloutScheduler:
    def new_group(group_id: int) -> list[Sample]:
        return [Sample(group_id=group_id, index=i, prompt="", prompt_ids=[5, 6, 7, 10 + group_id % 50])
                for i in range(GROUP)]

    return RolloutScheduler(router_url=url, engine_urls=[url],
                            params=SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, stop=stop),
                            prompts_per_step=4, partial=PartialRolloutConfig(mode=mode, over_sampling=over_sampling,
                                                                              max_staleness=max_staleness),
                            max_concurrency=max_concurrency, request_timeout_s=120, max_retries=2,
                            new_group=new_group, score=score,
                            detokenize=lambda ids: " ".join(map(str, ids)), dynamic_sampling=dynamic_sampling,
                            program=program, tokenize=lambda text: [int(t) for t in text.split()])


def check_batch(samples: list[Sample]) -> set[int]:
    groups = {}
    for sample in samples:
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.status
        assert 0 < len(sample.response_ids) <= MAX_NEW_TOKENS
        assert sample.reward == len(sample.response_ids), "scored after its last segment"
        sample.check()
        groups.setdefault(sample.group_id, []).append(sample.index)
    assert all(sorted(indices) == list(range(GROUP)) for indices in groups.values()), "whole groups only"
    return set(groups)


def test_abort_mode_hands_out_every_group_once_across_checkpoints(engine_url):
    # Left alone, the untrained model's responses mostly run to MAX_NEW_TOKENS, so groups that start together finish
    # together, and whether a request is still running when a batch is complete is luck (once, all 6 groups finished
    # in the same decode step). Stopping at the first "e" or "t" makes the lengths near geometric (short, and
    # spread), and 2 requests (a group each) at a time staggers the groups' starts.
    def abort_scheduler():
        return make_scheduler(engine_url, "abort", max_concurrency=2, stop=STOP_E_T)

    scheduler = abort_scheduler()
    trained: list[int] = []
    totals = {"requests_aborted": 0, "groups_continued": 0}
    multi_segment = 0
    try:
        for step in range(1, 13):
            samples, counters = scheduler.collect(policy_version=0)
            trained += sorted(check_batch(samples))
            multi_segment += sum(1 for s in samples if s.meta["segments"] > 1)
            for key in totals:
                totals[key] += counters.get(key, 0)
            if step % 3 == 0:  # what a checkpoint saves, through JSON, into a fresh scheduler
                state = json.loads(json.dumps(scheduler.state()))
                scheduler.close()
                scheduler = abort_scheduler()
                scheduler.load_state(state)
        left = {g["group_id"] for g in scheduler.state()["groups"]}
    finally:
        scheduler.close()
    assert len(trained) == len(set(trained)) == 48, "no group is trained twice"
    seen = set(trained) | left
    assert seen == set(range(max(seen) + 1)), "no group is lost"
    assert totals["requests_aborted"] > 0 and totals["groups_continued"] > 0 and multi_segment > 0, totals


def test_retract_pause_keeps_requests_alive(engine_url):
    """What a weight sync does in retract mode, after each batch: pause, resume. The engine is frozen and held with
    requests running (tests/e2e/hooks.py), so each pause retracts some; without over-sampling they are exactly the
    next batch's groups, which finish after the resume with their tokens. Their requests are sent only once the
    engine is frozen (a rollout program waits for it), so they cannot have finished before."""
    import httpx

    from tests.e2e.hooks import EngineFreezer, wait_for_batch_gate

    steps, frozen = 4, set()

    async def generate_once_frozen(sample, client):
        await wait_for_batch_gate(sample, frozen.__contains__, batch_groups=4)
        return await client.generate(sample)

    scheduler = make_scheduler(engine_url, "retract", over_sampling=0, program=generate_once_frozen)
    try:
        with httpx.Client(timeout=30) as http:
            freezer = EngineFreezer(http)
            for step in range(steps):
                samples, _ = scheduler.collect(policy_version=0)
                check_batch(samples)
                if step > 0:
                    assert sum(s.meta["num_retractions"] for s in samples) > 0, step
                freezer.freeze([engine_url])  # as the driver's phase hook does while the trainer trains
                frozen.add(step + 1)  # the next batch's requests may go
                freezer.hold_running([engine_url])
                scheduler.pause()
                scheduler.resume(policy_version=0)
    finally:
        scheduler.close()


@pytest.mark.parametrize("synced_to", [0, 5])
def test_engines_behind_the_policy_fail_loudly(engine_url, synced_to):
    """The engine serves version 0. Told so, a policy at version 5 is too far ahead of it; told it was synced to
    version 5, it answers with version-0 tokens: either way regenerating cannot help."""
    scheduler = make_scheduler(engine_url, "abort", max_staleness=1)
    try:
        scheduler.resume(policy_version=synced_to)
        with pytest.raises(RuntimeError, match="do not serve the trained weights"):
            scheduler.collect(policy_version=5)
    finally:
        scheduler.close()


def reward_varies_in_odd_groups(samples: list[Sample]) -> int:
    """Even group ids: every sample 1.0 (no variance); odd: the sample's index (always varies)."""
    for sample in samples:
        sample.reward = 1.0 if sample.group_id % 2 == 0 else float(sample.index)
    return 0


def one_dynamic_step(url: str, score, *, max_extra_groups: int) -> tuple[list[Sample], dict]:
    """One step's samples and counters from a mode-off scheduler of 4 groups with dynamic sampling."""
    scheduler = make_scheduler(url, "off", over_sampling=0, score=score,
                               dynamic_sampling=DynamicSamplingConfig(enabled=True, max_extra_groups=max_extra_groups))
    try:
        return scheduler.collect(policy_version=0)
    finally:
        scheduler.close()


def test_dynamic_sampling_replaces_groups_without_reward_variance(engine_url):
    """Groups 0-3 start; each dropped even group frees a place for the next id, so the step's four odd groups
    (1, 3, 5, 7) are complete only after groups 0, 2, 4 and 6 were dropped."""
    samples, counters = one_dynamic_step(engine_url, reward_varies_in_odd_groups, max_extra_groups=64)
    groups = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    assert sorted(groups) == [1, 3, 5, 7] and all(informative(g) for g in groups.values())
    assert counters["groups_dropped_uninformative"] == 4 and counters.get("groups_kept_uninformative", 0) == 0


def test_dynamic_sampling_keeps_uninformative_groups_past_its_bound(engine_url):
    def no_variance(samples: list[Sample]) -> int:
        for sample in samples:
            sample.reward = 1.0
        return 0

    samples, counters = one_dynamic_step(engine_url, no_variance, max_extra_groups=1)
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


def test_a_rollout_programs_samples_take_the_place_of_its_sample(engine_url):
    """What a program returns replaces its sample in the group (renumbered); a program that raises fails its sample
    (counted), and the group trains without it."""
    scheduler = make_scheduler(engine_url, "off", over_sampling=0, program=twins_but_index_1_fails,
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
