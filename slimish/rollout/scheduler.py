"""Schedules generation by GRPO group, with partial rollouts (abort / retract).

A *group* is one prompt's `samples_per_prompt` samples. The scheduler runs an asyncio loop on a thread of its own,
keeps up to `prompts_per_step + over_sampling` groups either generating or finished (scored and waiting), and hands
the driver `prompts_per_step` finished groups per step (`collect`). rollout.partial.mode decides what happens to
the rest:

  off      generation runs only inside `collect`, for exactly the step's groups.
  abort    `collect` over-samples; once `prompts_per_step` groups are finished, every request still running is
           aborted on every engine (SGLang answers it with the tokens generated so far), and those groups wait in
           the partial buffer, to be continued first in the next step (input = prompt + partial response).
  retract  generation never stops: the next step's groups are generated while the trainer trains. Around each
           weight sync the driver calls `pause` (running requests go back to the engines' queues, their KV freed)
           and `resume`; they then continue with the new weights. Each token carries the version that sampled it.

Dynamic sampling (rollout.dynamic_sampling): a scored group whose rewards are all equal (no GRPO signal) is dropped
and, since it no longer fills a place, a new group is drawn instead; at most `max_extra_groups` are dropped between
two `collect`s, after which such groups are kept (counted).

Staleness: a group whose oldest token is more than `max_staleness` versions older than the policy it would train is
generated again from its prompt (counted in `groups_restarted_stale`). Nothing is lost at a checkpoint: `state()`
holds the partial buffer, the finished groups not yet trained, and the prompts of groups still generating.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from slimish.config.schema import DynamicSamplingConfig, PartialRolloutConfig
from slimish.engines.generation import GenerationClient, RequestError
from slimish.rollout.generate import SamplingParams, finish_multi_segment, generate_batch
from slimish.rollout.programs import Interrupted, RequestFailed, RolloutClient
from slimish.sample import Sample, Status

logger = logging.getLogger(__name__)

ABORT_RETRY_S = 1.0  # re-send abort_all while requests are still out (one may reach an engine after the abort)
RETRY_DELAY_S = 2.0  # times the attempt number: longer than the watchdog takes to unroute a dead engine


@dataclass
class Group:
    group_id: int
    samples: list[Sample]
    outstanding: int = 0  # requests in flight
    restarts: int = 0  # times regenerated from the prompt (stale); part of request ids
    submitted_version: int = 0  # the weight version the engines served when it was last submitted

    def oldest_version(self) -> int | None:
        versions = [v for s in self.samples for v in s.weight_versions]
        return min(versions) if versions else None

    def to_dict(self) -> dict:
        return {"group_id": self.group_id, "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, data: dict) -> Group:
        return cls(group_id=data["group_id"], samples=[Sample.from_dict(s) for s in data["samples"]])


def informative(samples: list[Sample]) -> bool:
    """A group carries a GRPO signal: at least two of its samples have rewards, and they are not all equal."""
    rewards = [s.reward for s in samples if s.scored]
    return len(rewards) >= 2 and max(rewards) != min(rewards)


class RolloutScheduler:
    """Thread-safe front (`collect`, `pause`, `resume`, `state`, `load_state`, `close`) over the generation loop.

    `engines` generates through the router and reaches `engine_urls` for control calls; the scheduler uses it on its
    own loop only and closes it in `close()`. At most `max_concurrency` requests are out at once.
    `new_group(group_id)` returns the samples of the next prompt; `score(samples)` sets their rewards and returns
    the number of reward failures (called on a worker thread); `detokenize(ids)` gives the text of a response that
    was generated in several requests."""

    def __init__(self, *, engines: GenerationClient, engine_urls: list[str], params: SamplingParams,
                 prompts_per_step: int, partial: PartialRolloutConfig, max_concurrency: int, max_retries: int,
                 new_group: Callable[[int], list[Sample]], score: Callable[[list[Sample]], int],
                 detokenize: Callable[[list[int]], str], dynamic_sampling: DynamicSamplingConfig | None = None,
                 program: Callable | None = None, tokenize: Callable[[str], list[int]] | None = None):
        self._engines, self.engine_urls, self.params = engines, list(engine_urls), params
        self.max_retries = max_retries
        self.batch_groups, self.mode = prompts_per_step, partial.mode
        self.capacity = prompts_per_step + partial.over_sampling
        self.max_staleness = partial.max_staleness
        self._new_group, self._score, self._detokenize = new_group, score, detokenize
        self._program, self._tokenize = program, tokenize  # rollout.generate_fn (slimish/rollout/programs.py)
        self.dynamic_sampling = dynamic_sampling or DynamicSamplingConfig()
        self._dropped = 0  # uninformative groups dropped since the last collect
        self._max_concurrency = max_concurrency
        self._rid_prefix = uuid.uuid4().hex[:8]
        self._next_group_id = 0
        self._policy_version = 0  # the version that trains the batch being collected (staleness is measured to it)
        self._engine_version = 0  # the version the engines serve (as of the last resume)
        self._backlog: collections.deque[Group] = collections.deque()  # to (re)submit; partial groups first
        self._active: dict[int, Group] = {}  # submitted: generating or being scored
        self._ready: list[Group] = []  # finished and scored
        self._accepting = False
        self._counters: collections.Counter = collections.Counter()
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-scheduler", daemon=True)
        self._thread.start()
        self._call(self._setup())

    # ------------------------------------------------------------------------------------- thread-safe API
    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def collect(self, *, policy_version: int) -> tuple[list[Sample], dict]:
        """The samples of `prompts_per_step` finished groups (group by group) and the scheduler's counters since the
        last call. `policy_version` is the weight version that will train them (the engines serve it, or, with
        rl.mode one_step_off / async, an older one)."""
        return self._call(self._collect(policy_version))

    def pause(self) -> None:
        """Before a weight sync in retract mode: running requests are retracted to the engines' queues. An engine
        that does not answer (it may have just died) is skipped: a weight update on an engine that is not paused
        waits for its running requests instead."""
        if self.mode == "retract":
            self._call(self._control_all("pause", self._engines.pause_all))

    def resume(self, *, policy_version: int) -> None:
        """After a weight sync: the engines serve `policy_version`; retracted requests continue."""
        self._engine_version = policy_version
        if self.mode == "retract":
            self._call(self._control_all("continue", self._engines.continue_all))

    @property
    def engine_version(self) -> int:
        """The weight version the engines serve (as of the last resume)."""
        return self._engine_version

    def set_engine_urls(self, urls: list[str]) -> None:
        """The engines that control calls (abort, pause, continue) go to: the live ones."""
        self.engine_urls = list(urls)

    def state(self) -> dict:
        """Everything not yet trained on: the partial buffer and finished groups as they are, groups still
        generating as their prompts (restarted on load)."""
        return self._call(self._state())

    def load_state(self, state: dict) -> None:
        self._call(self._load_state(state))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    # ------------------------------------------------------------------------------------------ the loop
    async def _setup(self) -> None:
        self._semaphore = asyncio.Semaphore(self._max_concurrency)
        self._changed = asyncio.Event()

    async def _collect(self, policy_version: int) -> tuple[list[Sample], dict]:
        self._policy_version = policy_version
        t0 = time.monotonic()
        self._accepting = True
        self._restart_stale_backlog()
        self._refill()
        while True:
            self._restart_stale_ready()
            if len(self._ready) >= self.batch_groups:
                break
            self._refill()
            self._changed.clear()
            await self._changed.wait()
        batch, self._ready = self._ready[:self.batch_groups], self._ready[self.batch_groups:]
        self._dropped = 0
        time_wait = time.monotonic() - t0
        if self.mode == "retract":
            self._refill()  # the next step's groups generate while this one trains
        else:
            self._accepting = False
            await self._abort_in_flight()
        counters, self._counters = self._counters, collections.Counter()
        samples = [s for group in batch for s in group.samples]
        return samples, {**counters, "time_generate_s": time_wait, "time_abort_s": time.monotonic() - t0 - time_wait,
                         "partial_buffer_groups": sum(1 for g in self._backlog if g.oldest_version() is not None),
                         "groups_waiting": len(self._ready)}

    def _refill(self) -> None:
        while self._accepting and len(self._active) + len(self._ready) < self.capacity:
            if self._backlog:
                group = self._backlog.popleft()
            else:
                group = Group(self._next_group_id, self._new_group(self._next_group_id))
                self._next_group_id += 1
            self._submit(group)

    def _submit(self, group: Group) -> None:
        """Start generating `group`'s unfinished samples: one request per set of samples with the same token budget
        (a new group is one request), or one rollout program per sample."""
        self._active[group.group_id] = group
        group.submitted_version = self._engine_version
        if group.oldest_version() is not None:
            self._counters["groups_continued"] += 1
        todo = [s for s in group.samples if s.status in (Status.PENDING, Status.ABORTED)]
        for sample in todo:
            sample.status = Status.PENDING
        def rid(first: Sample) -> str:
            return f"slimish-{self._rid_prefix}-{group.group_id}-{group.restarts}-{first.index}-" \
                   f"{first.meta.get('segments', 0)}"

        if self._program is not None:
            work = [self._run_program(group, s, rid(s)) for s in todo]
        else:
            by_budget: dict[int, list[Sample]] = {}
            for sample in todo:
                by_budget.setdefault(len(sample.response_ids), []).append(sample)
            work = [self._generate_batch(group, batch, rid(batch[0])) for batch in by_budget.values()]
        group.outstanding += len(work)
        for coro in work:
            task = self._loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if group.outstanding == 0:  # nothing left to generate (e.g. every sample failed before an abort)
            self._finish(group)

    async def _run_program(self, group: Group, sample: Sample, rid: str) -> None:
        """One sample through the rollout program: what it returns takes the sample's place in its group. An
        interrupted program leaves the sample aborted (continued later); one whose request failed for good, or that
        raised, leaves it failed (counted: requests_failed, program_errors)."""
        model_tokens = sum(sample.loss_mask)
        client = RolloutClient(engines=self._engines, params=self.params, semaphore=self._semaphore,
                               rid=rid, max_retries=self.max_retries, retry_delay_s=RETRY_DELAY_S,
                               tokenize=self._tokenize, detokenize=self._detokenize,
                               policy_version=lambda: self._engine_version,
                               on_retry=lambda: self._counters.update(["requests_retried"]))
        try:
            try:
                returned = await self._program(sample, client)
                results = [returned] if isinstance(returned, Sample) else list(returned)
                if not results or any(not isinstance(s, Sample) or not s.finished for s in results):
                    raise TypeError(f"returned {returned!r}: a finished Sample or a non-empty list of them")
            except Interrupted:
                results = [sample]
                self._counters["requests_aborted"] += 1
            except RequestFailed as exc:
                sample.status, sample.error, results = Status.FAILED, str(exc), [sample]
                self._counters["requests_failed"] += 1
                logger.warning("a request of %s failed for good, its sample will not train: %s", rid, exc)
            except Exception as exc:  # the program's own error: its sample fails, the job goes on
                sample.status, sample.error, results = Status.FAILED, f"{type(exc).__name__}: {exc}", [sample]
                self._counters["program_errors"] += 1
                logger.warning("the rollout program failed on %s, its sample will not train", rid, exc_info=True)
            for result in results:
                result.group_id = group.group_id
                result.meta["program"] = True
                if result.status in (Status.COMPLETED, Status.TRUNCATED):
                    result.response = self._detokenize(result.response_ids)
            self._counters["engine_tokens"] += sum(sum(s.loss_mask) for s in results) - model_tokens
            if len(results) != 1 or results[0] is not sample:
                at = next(i for i, s in enumerate(group.samples) if s is sample)
                group.samples[at:at + 1] = results
        finally:
            group.outstanding -= 1
        if group.outstanding == 0:
            self._finish(group)

    async def _generate_batch(self, group: Group, samples: list[Sample], rid: str) -> None:
        """One request for `samples` (a share of `group` with the same token budget); a request whose engine failed
        is sent again (after a pause in which the watchdog takes a dead engine out of the router), up to
        `max_retries` times. Samples whose request still fails are FAILED: counted (per sample), never trained on,
        their group trained without them."""
        before = sum(len(s.response_ids) for s in samples)
        try:
            for attempt in range(self.max_retries + 1):
                try:
                    async with self._semaphore:
                        await generate_batch(self._engines, samples, self.params,
                                             rid=rid if attempt == 0 else f"{rid}-retry{attempt}")
                    break
                except RequestError as exc:
                    if not exc.retriable or attempt == self.max_retries:
                        for sample in samples:
                            sample.status, sample.error = Status.FAILED, str(exc)
                        self._counters["requests_failed"] += len(samples)
                        # Counted in metrics.jsonl; the reason is only here (and in run.save_rollouts files).
                        logger.warning("request %s failed after %d attempt(s), its %d sample(s) will not train: %s",
                                       rid, attempt + 1, len(samples), exc)
                        break
                    self._counters["requests_retried"] += 1
                    await asyncio.sleep(RETRY_DELAY_S * (attempt + 1))
            self._counters["engine_tokens"] += sum(len(s.response_ids) for s in samples) - before
            self._counters["requests_aborted"] += sum(1 for s in samples if s.status is Status.ABORTED)
        finally:
            group.outstanding -= 1
        if group.outstanding == 0:
            self._finish(group)

    def _finish(self, group: Group) -> None:
        """All of `group`'s requests returned: back to the buffer if any was aborted, else score it."""
        if any(s.status is Status.ABORTED for s in group.samples):
            del self._active[group.group_id]
            self._backlog.appendleft(group)
            self._changed.set()
            return
        task = self._loop.create_task(self._score_group(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _score_group(self, group: Group) -> None:
        try:
            for index, sample in enumerate(group.samples):
                sample.index = index  # a rollout program may have put several samples in one's place
                if sample.meta.get("segments", 0) > 1 and not sample.meta.get("program"):
                    # decode the whole response, not the segments' texts joined (a program's is decoded already)
                    finish_multi_segment(sample, self.params.stop, self._detokenize)
                if sample.status is not Status.FAILED:
                    sample.check()
            self._counters["reward_failures"] += await asyncio.to_thread(self._score, group.samples)
        finally:
            del self._active[group.group_id]
            if self._keep(group):
                self._ready.append(group)
            self._changed.set()
            self._refill()  # a dropped group's place is taken by a new one

    def _keep(self, group: Group) -> bool:
        """Whether a scored group goes to the step: always, unless dynamic sampling drops it (no reward variance,
        and fewer than `max_extra_groups` dropped since the last collect)."""
        if not self.dynamic_sampling.enabled or informative(group.samples):
            return True
        if self._dropped < self.dynamic_sampling.max_extra_groups:
            self._dropped += 1
            self._counters["groups_dropped_uninformative"] += 1
            return False
        self._counters["groups_kept_uninformative"] += 1
        return True

    async def _abort_in_flight(self) -> None:
        """Abort every running request on every engine until all have answered (their groups go to the buffer),
        then let the groups that were being scored land in `_ready`."""
        while any(g.outstanding for g in self._active.values()):
            await self._control_all("abort", self._engines.abort_all)
            pending = [t for t in self._tasks if not t.done()]
            if pending:  # (they may all have answered while the abort calls were out)
                await asyncio.wait(pending, timeout=ABORT_RETRY_S)
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending)

    def _stale(self, group: Group) -> bool:
        oldest = group.oldest_version()
        return bool(self.max_staleness) and oldest is not None and self._policy_version - oldest > self.max_staleness

    def _restart(self, group: Group) -> Group:
        for sample in group.samples:
            sample.restart()
        group.restarts += 1
        self._counters["groups_restarted_stale"] += 1
        return group

    def _restart_stale_backlog(self) -> None:
        self._backlog = collections.deque(self._restart(g) if self._stale(g) else g for g in self._backlog)

    def _restart_stale_ready(self) -> None:
        stale = [g for g in self._ready if self._stale(g)]
        for group in stale:  # when regenerating would not help, fail loudly
            newest = max(v for s in group.samples for v in s.weight_versions)
            if newest < group.submitted_version:
                raise RuntimeError(f"group {group.group_id} was sampled with weight version {newest} after the "
                                   f"engines were synced to version {group.submitted_version}: the engines do not "
                                   "serve the trained weights")
            if self._policy_version - self._engine_version > self.max_staleness:
                raise RuntimeError(f"the engines serve weight version {self._engine_version} and the policy is at "
                                   f"version {self._policy_version}, beyond rollout.partial.max_staleness "
                                   f"{self.max_staleness}: the engines do not serve the trained weights")
        if stale:
            self._ready = [g for g in self._ready if not self._stale(g)]
            self._backlog.extendleft(self._restart(g) for g in reversed(stale))

    async def _control_all(self, what: str, call: Callable[[list[str]], Awaitable[dict[str, BaseException]]]) -> None:
        """`call` (one of the engine client's pause_all, continue_all, abort_all; `what` names it in the log) on
        every live engine; an engine that fails is reported and skipped (it may just have died: the watchdog takes
        care of it)."""
        failures = await call(list(self.engine_urls))
        for url, error in failures.items():
            logger.warning("%s: %s failed: %s: %s", url, what, type(error).__name__, error)

    async def _state(self) -> dict:
        generating = [Group(g.group_id, [Sample.from_dict(s.to_dict()) for s in g.samples])
                      for g in self._active.values()]
        for group in generating:
            for sample in group.samples:
                sample.restart()
        return {"next_group_id": self._next_group_id,
                "groups": [g.to_dict() for g in [*self._ready, *self._backlog, *generating]]}

    async def _load_state(self, state: dict) -> None:
        self._next_group_id = state["next_group_id"]
        groups = [Group.from_dict(g) for g in state["groups"]]
        self._ready = [g for g in groups if all(s.finished for s in g.samples)]
        self._backlog = collections.deque(g for g in groups if not all(s.finished for s in g.samples))

    async def _shutdown(self) -> None:
        self._accepting = False
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        await self._engines.aclose()
