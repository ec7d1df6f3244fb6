"""Reward hooks for tests/rollout/test_reward_workers.py, named by dotted path (the worker process imports them)."""

from __future__ import annotations

import os
import time


def pid(completions, **kwargs):
    """The worker's pid as every reward (where did the hook run?)."""
    return [float(os.getpid())] * len(completions)


def holds_the_gil(completions, **kwargs):
    """One C call that holds the GIL far longer than any test's time limit (a thread cannot interrupt it)."""
    if any(c == "huge" for c in completions):
        9 ** (9 ** 9)
    return [1.0] * len(completions)


def sleeps(completions, **kwargs):
    if any(c == "slow" for c in completions):
        time.sleep(3600)
    return [1.0] * len(completions)


def dies(completions, **kwargs):
    if any(c == "die" for c in completions):
        os._exit(7)
    return [1.0] * len(completions)


def prints_and_tags(completions, samples, **kwargs):
    """Prints (must not break the worker's protocol) and writes sample.meta (must come back)."""
    print("a hook that prints to stdout")
    for sample in samples:
        sample.meta["seen_by"] = "worker"
    return [float(len(c)) for c in completions]


def no_arguments():
    return []


def infinite_for_long(completions, **kwargs):
    return [float("inf") if len(c) > 1 else 1.0 for c in completions]
