"""Reward hooks in worker processes (slimish/rollout/reward_workers.py): a hook that hangs, holds the GIL or kills
its process fails only its own samples, is killed, and the next call is scored by a fresh worker."""

from __future__ import annotations

import os

import pytest

from slimish.config.schema import RewardConfig
from slimish.hooks import HookError
from slimish.rollout.reward_workers import RewardWorkers, build
from tests.kit.samples import group

HOOKS = "tests.rollout.reward_hooks"


def _scored(texts):
    return group(texts, label="7")


@pytest.fixture
def workers(request):
    made = []

    def make(fn: str, *, timeout_s: float = 60.0, count: int = 1, **more):
        pool = RewardWorkers(RewardConfig(fn=fn, **more), workers=count, timeout_s=timeout_s, failure_reward=-1.0)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def test_the_hook_runs_in_a_worker_process_not_the_callers(workers):
    pool = workers(f"{HOOKS}.pid")
    samples = _scored(["a", "b"])
    assert pool.score(samples) == 0
    assert samples[0].reward == pool.pids()[0] != os.getpid()


def test_a_hook_holding_the_gil_is_killed_and_the_next_call_gets_a_fresh_worker(workers):
    pool = workers(f"{HOOKS}.holds_the_gil", timeout_s=1.0)
    first = pool.pids()[0]
    samples = _scored(["huge", "7"])
    assert pool.score(samples) == 2
    assert [s.reward for s in samples] == [-1.0, -1.0]
    assert "TimeoutError" in samples[0].error and "reward.timeout_s" in samples[0].error
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(first, 0)
    again = _scored(["7", "7"])
    assert pool.score(again) == 0 and [s.reward for s in again] == [1.0, 1.0]
    assert pool.restarts == 1 and pool.pids()[0] != first


def test_a_sleeping_hook_is_killed_at_its_time_limit(workers):
    pool = workers(f"{HOOKS}.sleeps", timeout_s=0.5)
    samples = _scored(["slow"])
    assert pool.score(samples) == 1 and "reward.timeout_s" in samples[0].error


def test_a_hook_that_kills_its_worker_fails_its_samples(workers):
    pool = workers(f"{HOOKS}.dies")
    samples = _scored(["die", "7"])
    assert pool.score(samples) == 2
    assert "reward worker died" in samples[0].error and "exit status 7" in samples[0].error
    again = _scored(["7"])
    assert pool.score(again) == 0 and again[0].reward == 1.0


def test_prints_do_not_break_the_protocol_and_meta_comes_back(workers, capfd):
    pool = workers(f"{HOOKS}.prints_and_tags")
    samples = _scored(["ab", "abc"])
    assert pool.score(samples) == 0
    assert [s.reward for s in samples] == [2.0, 3.0] and samples[0].meta["seen_by"] == "worker"
    assert "a hook that prints to stdout" in capfd.readouterr().err


def test_weighted_terms_and_failures_inside_the_worker_as_in_process(workers):
    pool = workers("slimish.tasks.echo_digit.reward", fns=[f"{HOOKS}.no_arguments"])
    samples = _scored(["7", "3"])
    assert pool.score(samples) == 2  # the second term takes no arguments: every sample fails, in the worker
    assert "TypeError" in samples[0].error


def test_non_finite_rewards_fail_their_samples_in_the_worker(workers):
    pool = workers(f"{HOOKS}.infinite_for_long")
    samples = _scored(["77", "7"])
    assert pool.score(samples) == 1
    assert "NonFiniteReward" in samples[0].error and samples[1].reward == 1.0


@pytest.mark.parametrize("fn, message", [
    (f"{HOOKS}.no_such_hook", "has no attribute 'no_such_hook'"),
    ("tests.rollout.broken_reward_hook.reward", "fails at import"),
    ("tests.rollout.not_a_module.reward", "cannot import module"),
])
def test_a_hook_that_cannot_load_fails_the_start_with_one_line(fn, message):
    with pytest.raises(HookError, match=message):
        RewardWorkers(RewardConfig(fn=fn), workers=1, timeout_s=5, failure_reward=0.0)


def test_the_shipped_math_reward_on_a_tower_of_powers_is_killed_not_waited_for(workers):
    """The issue's case: sympy on 9^{9^{9}} holds the GIL for minutes."""
    pool = workers("slimish.tasks.math_answer.reward", timeout_s=2.0)
    samples = _scored(["so \\boxed{9^{9^{9}}}", "\\boxed{7}"])
    assert pool.score(samples) == 2 and "reward.timeout_s" in samples[0].error
    again = _scored(["\\boxed{7}"])
    assert pool.score(again) == 0 and again[0].reward == 1.0


def test_workers_zero_calls_the_hook_in_process():
    scorer = build(RewardConfig(fn=f"{HOOKS}.pid", workers=0))
    samples = _scored(["a"])
    assert scorer.score(samples) == 0 and samples[0].reward == os.getpid()


def test_a_worker_started_from_a_thread_that_ends_lives_on(workers):
    """A replacement worker is started inside a scoring call, on the caller's thread (asyncio.to_thread's, whose
    event loop an evaluation closes). Linux kills a child with PR_SET_PDEATHSIG when the thread that forked it
    ends: the pool forks from a thread of its own, so the worker outlives the caller's thread."""
    import threading

    pool = workers(f"{HOOKS}.sleeps", timeout_s=0.5)
    caller = threading.Thread(target=lambda: pool.score(_scored(["slow"])))  # killed: replaced on the next call
    caller.start()
    caller.join()
    replacing = threading.Thread(target=lambda: pool.score(_scored(["7"])))
    replacing.start()
    replacing.join()  # the thread that asked for the replacement is gone
    samples = _scored(["7"])
    assert pool.score(samples) == 0 and samples[0].reward == 1.0 and pool.restarts == 1


def test_a_worker_killed_between_calls_fails_only_the_next_call_and_is_replaced(workers):
    """A worker that died while idle (the OOM killer, an operator's kill): the next call fails its samples with
    what happened, and the call after it is scored by a fresh worker."""
    import signal

    pool = workers(f"{HOOKS}.pid")
    os.kill(pool.pids()[0], signal.SIGKILL)
    samples = _scored(["a"])
    assert pool.score(samples) == 1 and "reward worker" in samples[0].error
    again = _scored(["a"])
    assert pool.score(again) == 0 and again[0].reward == pool.pids()[0]
