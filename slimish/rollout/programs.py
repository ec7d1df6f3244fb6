"""Rollout programs (`rollout.generate_fn`): multi-turn generation, tool use, environments.

A rollout program is an async function named by a dotted path:

    async def program(sample: Sample, client: RolloutClient) -> Sample | list[Sample]

It receives one sample of a group (its prompt, and the response so far when it is being continued) and drives it to
the end, calling the engines through `client.generate` as many times as it likes and inserting what the environment
says (tool results, user turns) with `client.append_environment`. Tokens the model generated are trained on
(`loss_mask` 1); environment tokens are not (`loss_mask` 0). Token ids and logprobs always come from the engine and
are never re-tokenised; environment text is tokenised once, when it is inserted.

A program is a function of the sample so far: when `client.generate` is interrupted (the job aborts in-flight requests
at the end of a step, `rollout.partial`), it raises `Interrupted`, the sample keeps every token generated and goes to
the partial-rollout buffer, and the program is called again with it later (possibly under newer weights: per-token
weight versions say which). It must then pick up from the transcript rather than start over: a continued sample
comes back with status pending, its last tokens the model's, cut off in the middle of a turn.

It returns the sample (finished: status completed or truncated), or several samples, which take its place in the
group (e.g. one per turn); `sample.response` is then the decoded transcript (model and environment text) unless the
program set it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace

from slimish.engines.generation import GenerationClient, RequestError
from slimish.rollout.generate import SamplingParams, generate_one
from slimish.sample import Sample, Status


class Interrupted(Exception):
    """The engine aborted the request (end of step, partial rollout): return; the program is called again later."""


class RequestFailed(Exception):
    """The engines failed the request for good (after retries): the sample fails and is not trained on."""


class RolloutClient:
    """What a rollout program gets: the policy behind the router, and the tokenizer."""

    def __init__(self, *, engines: GenerationClient, params: SamplingParams, semaphore: asyncio.Semaphore,
                 rid: str, max_retries: int, retry_delay_s: float, tokenize: Callable[[str], list[int]],
                 detokenize: Callable[[list[int]], str], policy_version: Callable[[], int],
                 on_retry: Callable[[], None] = lambda: None):
        self._engines, self.params, self._semaphore = engines, params, semaphore
        self._rid, self._calls = rid, 0
        self._max_retries, self._retry_delay_s, self._on_retry = max_retries, retry_delay_s, on_retry
        self.tokenize, self.detokenize, self._policy_version = tokenize, detokenize, policy_version

    def remaining(self, sample: Sample) -> int:
        """Response tokens left in the budget (`rollout.max_new_tokens` covers model and environment tokens)."""
        return self.params.max_new_tokens - len(sample.response_ids)

    async def generate(self, sample: Sample, *, stop: Sequence[str] | None = None) -> Sample:
        """Continue `sample` with the policy until EOS, a stop string (`stop`, default `rollout.stop`) or the budget;
        the model's tokens, logprobs and weight versions are appended with `loss_mask` 1 and the status is set
        (completed / truncated). Raises `Interrupted` if the engine aborted the request, `RequestFailed` if the
        engines failed it `rollout.max_retries` times."""
        if self.remaining(sample) <= 0:
            sample.status = Status.TRUNCATED
            return sample
        params = self.params if stop is None else replace(self.params, stop=tuple(stop))
        for attempt in range(self._max_retries + 1):
            self._calls += 1
            try:
                async with self._semaphore:
                    await generate_one(self._engines, sample, params, rid=f"{self._rid}-call{self._calls}")
                break
            except RequestError as exc:
                if not exc.retriable or attempt == self._max_retries:
                    raise RequestFailed(str(exc)) from exc
                self._on_retry()
                await asyncio.sleep(self._retry_delay_s * (attempt + 1))
        if sample.status is Status.ABORTED:
            raise Interrupted(f"sample {sample.group_id}/{sample.index} aborted")
        return sample

    def append_environment(self, sample: Sample, text: str) -> list[int]:
        """Append `text` (tokenised here, once) as environment tokens: `loss_mask` 0, logprob 0.0, and the weight
        version of the model token it answers (the current policy's if none); `meta["environment_spans"]` gets its
        [start, end) in the response. Returns the ids appended. Cut to the budget; a sample whose budget it fills is
        truncated."""
        ids = self.tokenize(text)[:max(self.remaining(sample), 0)]
        version = sample.weight_versions[-1] if sample.weight_versions else self._policy_version()
        start = len(sample.response_ids)
        sample.meta.setdefault("environment_spans", []).append([start, start + len(ids)])
        sample.response_ids = sample.response_ids + ids
        sample.rollout_logprobs = sample.rollout_logprobs + [0.0] * len(ids)
        sample.weight_versions = sample.weight_versions + [version] * len(ids)
        sample.loss_mask = sample.loss_mask + [0] * len(ids)
        if self.remaining(sample) <= 0:
            sample.status = Status.TRUNCATED
        return ids


async def single_turn(sample: Sample, client: RolloutClient) -> Sample:
    """The default rollout in program form: one generation (continued if it was interrupted)."""
    return await client.generate(sample)
