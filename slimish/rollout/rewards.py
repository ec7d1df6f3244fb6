"""Call the user's reward hook `fn(completions, **kwargs) -> list[float]` and contain its failures.

The hook is called as TRL calls a reward function: the completions, then by keyword `prompts`, `labels`, `samples`
(slimish's `Sample`s) and every other column of the samples' dataset rows under its own name (a list, one value per
completion; None where a row lacks it). A column named like one of those keywords is left out.

A hook that raises, returns the wrong shape or overruns its time limit does not stop the run: the affected samples
get `failure_reward`, carry the error, and are counted in `reward_failures`. A value that is not finite (NaN, inf) is
such a failure of its own sample, never a reward: one inf reward would make a GRPO group's advantages NaN.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable

from slimish.sample import Sample


class RewardContractError(ValueError):
    """The hook returned something other than one float per completion."""


class NonFiniteReward(ValueError):
    """The hook returned NaN or an infinity for a completion."""


RESERVED = ("completions", "prompts", "labels", "samples")


def column_kwargs(samples: list[Sample]) -> dict[str, list]:
    """Every dataset column of `samples` by name, one value per sample, except the reserved keywords."""
    names = dict.fromkeys(name for s in samples for name in s.columns)
    return {name: [s.columns.get(name) for s in samples] for name in names if name not in RESERVED}


def _call(fn: Callable, samples: list[Sample]) -> list[float]:
    rewards = fn([s.response for s in samples], **column_kwargs(samples), prompts=[s.prompt for s in samples],
                 labels=[s.label for s in samples], samples=samples)
    rewards = [float(r) for r in rewards]
    if len(rewards) != len(samples):
        raise RewardContractError(f"reward fn returned {len(rewards)} values for {len(samples)} completions")
    return rewards


def score(samples: list[Sample], fn: Callable, *, failure_reward: float, timeout_s: float = 0.0) -> int:
    """Set `sample.reward` on every scored sample; returns how many samples' rewards failed.

    The hook is called once for the whole batch; if that raises, it is called per sample so that one bad
    completion only fails itself. A broken contract (wrong length) fails the whole batch; a value that is not finite
    fails its own sample. With `timeout_s`
    the hook runs on copies of the samples in a thread of its own: past the limit every sample fails and the call
    is abandoned (a Python thread cannot be stopped; it runs on in the background, and what it returns is dropped).
    """
    if timeout_s <= 0:
        return _score(samples, fn, failure_reward=failure_reward)
    copies = [copy.copy(s) for s in samples]
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(_score(copies, fn, failure_reward=failure_reward)),
                              name="reward-hook", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not result:
        return fail([s for s in samples if s.scored], TimeoutError(f"no answer within {timeout_s:g}s "
                                                                    "(reward.timeout_s)"), failure_reward)
    for sample, scored in zip(samples, copies):
        sample.reward, sample.error = scored.reward, scored.error
    return result[0]


def _score(samples: list[Sample], fn: Callable, *, failure_reward: float) -> int:
    scored = [s for s in samples if s.scored]
    if not scored:
        return 0
    try:
        return sum(_set(sample, reward, failure_reward) for sample, reward in zip(scored, _call(fn, scored)))
    except RewardContractError as exc:
        return fail(scored, exc, failure_reward)
    except Exception:
        pass
    failures = 0
    for sample in scored:
        try:
            failures += _set(sample, _call(fn, [sample])[0], failure_reward)
        except Exception as exc:
            failures += fail([sample], exc, failure_reward)
    return failures


def _set(sample: Sample, reward: float, failure_reward: float) -> int:
    """`sample.reward = reward` if it is finite (0 failures), else the sample fails (1)."""
    if not math.isfinite(reward):
        return fail([sample], NonFiniteReward(f"reward fn returned {reward} for this completion"), failure_reward)
    sample.reward = reward
    return 0


def fail(samples: list[Sample], exc: Exception, failure_reward: float) -> int:
    for sample in samples:
        sample.reward = failure_reward
        sample.error = f"reward failed: {type(exc).__name__}: {exc}"
    return len(samples)


def build_reward_fn(reward):
    """The reward hook of `reward` (RewardConfig): its one hook, or the weighted sum of its terms (reward.fn,
    reward.fns, reward.url, in that order)."""
    from slimish.hooks import load_function
    from slimish.rollout.remote_reward import RemoteReward

    names = ([reward.fn] if reward.fn else []) + list(reward.fns)
    fns = [load_function(dotted) for dotted in names]
    if reward.url:
        names.append("remote")
        fns.append(RemoteReward(reward.url, max_concurrency=reward.max_concurrency, retries=reward.retries,
                                timeout_s=reward.request_timeout_s, batch_size=reward.batch_size))
    weights = list(reward.weights) or [1.0] * len(fns)
    return weighted_sum(list(zip(names, fns, weights)))


def weighted_sum(terms: list[tuple[str, Callable, float]]) -> Callable:
    """One hook from several: sum of weight x each term's rewards (every term is called with the same arguments).
    Each sample keeps its terms' values in `meta["reward_terms"]` (for the metrics). A term that fails fails the
    sum, so `score` retries per sample and counts the failure."""
    if len(terms) == 1 and terms[0][2] == 1.0:
        return terms[0][1]

    def combined(completions, **kwargs):
        total = [0.0] * len(completions)
        values = {}
        for name, fn, weight in terms:
            rewards = [float(r) for r in fn(completions, **kwargs)]
            if len(rewards) != len(completions):
                raise RewardContractError(f"reward term {name!r} returned {len(rewards)} values for "
                                          f"{len(completions)} completions")
            values[name] = rewards
            total = [t + weight * r for t, r in zip(total, rewards)]
        for k, sample in enumerate(kwargs.get("samples") or []):
            sample.meta["reward_terms"] = {name: rewards[k] for name, rewards in values.items()}
        return total

    return combined
