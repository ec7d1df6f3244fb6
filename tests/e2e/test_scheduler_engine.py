"""The group scheduler against one real SGLang CPU engine (no router, no trainer), for what needs a real engine's
abort and retract: every group is handed out exactly once across aborts, continuations and checkpoint round
trips; retract pauses keep requests alive. The scheduler's other rules run against a stand-in engine in the fast
tier (tests/rollout/test_scheduler_logic.py).

The engine is the first of the e2e tier's shared engines (tests/e2e/shared_engines.py, with their key), reset to
its checkpoint first: the untrained model's responses are what these tests expect, and the job before may have
trained it. (Until 2026-11-27 these tests started an engine of their own, ~20 s.)"""

from __future__ import annotations

import json

import pytest

from tests.rollout.scheduler_kit import check_batch, make_scheduler

STOP_E_T = ("e", "t")  # about one character in 18 of the untrained model's output: lengths near geometric


@pytest.fixture
def engine(attached):
    """(URL, key) of shared engine 0, serving its checkpoint's (the untrained) weights."""
    attached.reset(0)
    return attached.urls[0], attached.key


def test_abort_mode_hands_out_every_group_once_across_checkpoints(engine):
    engine_url, api_key = engine
    # Left alone, the untrained model's responses mostly run to MAX_NEW_TOKENS, so groups that start together finish
    # together, and whether a request is still running when a batch is complete is luck (once, all 6 groups finished
    # in the same decode step). Stopping at the first "e" or "t" makes the lengths near geometric (short, and
    # spread), and 2 requests (a group each) at a time staggers the groups' starts.
    def abort_scheduler():
        return make_scheduler(engine_url, "abort", max_concurrency=2, stop=STOP_E_T, api_key=api_key)

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


def test_retract_pause_keeps_requests_alive(engine):
    """What a weight sync does in retract mode, after each batch: pause, resume. The engine is frozen and held with
    requests running (tests/e2e/hooks.py), so each pause retracts some; without over-sampling they are exactly the
    next batch's groups, which finish after the resume with their tokens. Their requests are sent only once the
    engine is frozen (a rollout program waits for it), so they cannot have finished before."""
    import httpx

    from slimish.network import auth_headers
    from tests.e2e.hooks import EngineFreezer, wait_for_batch_gate

    engine_url, api_key = engine
    steps, frozen = 4, set()

    async def generate_once_frozen(sample, client):
        await wait_for_batch_gate(sample, frozen.__contains__, batch_groups=4)
        return await client.generate(sample)

    scheduler = make_scheduler(engine_url, "retract", over_sampling=0, program=generate_once_frozen,
                               api_key=api_key)
    try:
        with httpx.Client(timeout=30, headers=auth_headers(api_key)) as http:
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
