"""Rollout manager: the prompt stream, the reward hook, the group scheduler and evaluation, over the job's engines
(`EngineFleet`, which it owns: its engine calls are one-line delegations); produces scored samples, one step's groups
at a time."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from slimish.config.schema import JobConfig
from slimish.engines.fleet import EngineFleet
from slimish.engines.generation import GenerationClient
from slimish.engines.servers import EngineServers
from slimish.hooks import load_function
from slimish.rollout import overlong, reward_workers
from slimish.rollout.data import PromptDataset, sft_samples
from slimish.rollout.evaluation import EvalSet, evaluate
from slimish.rollout.generate import SamplingParams
from slimish.rollout.scheduler import RolloutScheduler
from slimish.sample import Sample, Status


def load_parts(cfg: JobConfig, *, log_dir: str, engine_options: list[list[dict]], api_key: str | None = None) -> dict:
    """A `RolloutManager`'s parts, loaded as `cfg` says: its keyword arguments but `progress_bar`. The engines go to
    `engine_options` (their placement slots) and require `api_key`; their logs go to `log_dir`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    data, ev = cfg.data, cfg.eval
    dataset = PromptDataset(data.path, tokenizer=tokenizer, prompt_key=data.prompt_key, label_key=data.label_key,
                            shuffle=data.shuffle, seed=cfg.run.seed, chat_template=data.apply_chat_template,
                            split=data.split)
    eval_sets = [EvalSet(path, tokenizer=tokenizer, prompt_key=data.prompt_key, label_key=data.label_key,
                         chat_template=data.apply_chat_template, max_prompts=ev.max_prompts)
                 for path in ([ev.data_path] + list(ev.more_data_paths) if ev.every > 0 else [])]
    servers = EngineServers(rollout=cfg.rollout, model=cfg.model, log_dir=Path(log_dir), seed=cfg.run.seed,
                            engine_options=engine_options, api_key=api_key, colocated=cfg.placement.colocate)
    program = load_function(cfg.rollout.generate_fn) if cfg.rollout.generate_fn else None
    return {"tokenizer": tokenizer, "dataset": dataset, "reward": reward_workers.build(cfg.reward),
            "program": program, "eval_sets": eval_sets, "servers": servers}


class RolloutManager:
    """The rollout side of a job, built from its parts: the tokenizer, the prompt stream, the reward hook, the
    rollout program (None: one generation), the eval sets and the engine servers (`load_parts` loads them as the
    config says; a job's Ray actor is a `ConfiguredRolloutManager`). `start()` starts the engines (`EngineFleet`) and
    builds the scheduler on them."""

    def __init__(self, cfg: JobConfig, *, tokenizer, dataset: PromptDataset, reward,
                 program: Callable | None, eval_sets: list[EvalSet], servers: EngineServers,
                 progress_bar: bool = False):
        """`progress_bar`: draw a bar of the step's scored groups on the driver's terminal (only where the driver's
        output is one: redrawn into a file or a pipe, a bar turns into a line per refresh among the step lines)."""
        self.cfg = cfg
        self.tokenizer, self.dataset, self.reward, self.program = tokenizer, dataset, reward, program
        self.eval_sets = eval_sets
        self.fleet = EngineFleet(servers, cfg.rollout)
        ro = cfg.rollout  # training rollouts and evaluation sample alike
        self.sampling = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
                                       stop=tuple(str(s) for s in ro.stop))
        self.scheduler: RolloutScheduler | None = None
        self.progress_bar = progress_bar
        self._progress = None  # the current step's rollout progress bar
        self.totals = Counter()

    def start(self, sender_gpus: list[dict] | None = None) -> dict:
        """Start the engines (`EngineFleet.start`; `sender_gpus[i]`: colocated, where the trainer rank that sends
        engine i weights by CUDA IPC has its GPUs), the scheduler, and the fleet's watchdog, which tells the scheduler
        when the engines in service change."""
        info = self.fleet.start(sender_gpus)
        ro = self.cfg.rollout
        generation = GenerationClient(self.fleet.router_url, request_timeout_s=ro.request_timeout_s,
                                      max_concurrency=ro.max_concurrency, api_key=self.fleet.api_key)
        self.scheduler = RolloutScheduler(
            engines=generation, engine_urls=self.fleet.engine_urls, params=self.sampling,
            prompts_per_step=ro.prompts_per_step, partial=ro.partial, max_concurrency=ro.max_concurrency,
            max_retries=ro.max_retries, new_group=self._new_group, score=self._score, detokenize=self._detokenize,
            dynamic_sampling=ro.dynamic_sampling, program=self.program, tokenize=self._tokenize)
        self.fleet.watch(on_live_change=self.scheduler.set_engine_urls)
        return info

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def sft_samples(self, path: str) -> list[Sample]:
        """The SFT warm-up's samples from `path`, with this job's tokenizer (`slimish.rollout.data.sft_samples`)."""
        return sft_samples(path, self.tokenizer)

    def gpu_telemetry(self) -> dict[str, float]:
        return self.fleet.gpu_telemetry()

    def _new_group(self, group_id: int) -> list[Sample]:
        prompt = self.dataset.next_batch(1)[0]
        return [Sample(group_id=group_id, index=i, prompt=prompt.text, prompt_ids=list(prompt.ids), label=prompt.label,
                       columns=prompt.columns) for i in range(self.cfg.rollout.samples_per_prompt)]

    def _score(self, samples: list[Sample]) -> int:
        failures = self.reward.score(samples)
        overlong.apply(samples, self.cfg.rollout.overlong, max_tokens=self.cfg.rollout.max_new_tokens)
        if self._progress is not None:
            self._progress.update(1)
        return failures

    def rollout(self, *, policy_version: int) -> tuple[list[Sample], dict]:
        """`prompts_per_step` scored groups (see `RolloutScheduler.collect`) and the step's rollout metrics."""
        from ray.experimental import tqdm_ray  # a bar the driver draws, fed from this actor

        t0 = time.monotonic()
        # Groups scored so far this step (dropped ones count too: the bar shows work, not the step's yield).
        if self.progress_bar:
            self._progress = tqdm_ray.tqdm(total=self.cfg.rollout.prompts_per_step, desc="rollout groups",
                                           position=0)
        try:
            samples, counters = self.scheduler.collect(policy_version=policy_version)
        finally:
            if self._progress is not None:
                self._progress.close()
                self._progress = None
        statuses = Counter(s.status.value for s in samples)
        self.totals.update(statuses)
        self.totals["reward_failures"] += counters.get("reward_failures", 0)
        trainable = [s for s in samples if s.trainable]
        n_tokens = sum(len(s.response_ids) for s in samples)
        staleness = [policy_version - v for s in trainable for v in s.weight_versions]
        metrics = {
            "reward_mean": sum(s.reward for s in trainable) / max(len(trainable), 1),
            "response_len_mean": n_tokens / max(len(samples), 1),
            **overlong.metrics(samples),
            "generated_tokens": n_tokens,
            "reward_failures": counters.get("reward_failures", 0),
            "requests_retried": counters.get("requests_retried", 0),
            "requests_failed": counters.get("requests_failed", 0),
            **self.fleet.metrics(),
            "engine_tokens": counters.get("engine_tokens", 0),
            "requests_aborted": counters.get("requests_aborted", 0),
            "groups_continued": counters.get("groups_continued", 0),
            "groups_restarted_stale": counters.get("groups_restarted_stale", 0),
            "groups_dropped_uninformative": counters.get("groups_dropped_uninformative", 0),
            "groups_kept_uninformative": counters.get("groups_kept_uninformative", 0),
            "partial_buffer_groups": counters["partial_buffer_groups"],
            "samples_multi_segment": sum(1 for s in samples if s.meta.get("segments", 0) > 1),
            "num_retractions": sum(s.meta.get("num_retractions", 0) for s in samples),
            "staleness_max": max(staleness, default=0),
            "off_policy_token_frac": sum(1 for d in staleness if d > 0) / max(len(staleness), 1),
            "time_generate_s": counters["time_generate_s"],
            "time_abort_s": counters["time_abort_s"],
            "time_collect_s": time.monotonic() - t0,
            **{f"samples_{status.value}": statuses.get(status.value, 0) for status in Status
               if status is not Status.PENDING},
        }
        return samples, metrics

    def evaluate(self) -> tuple[dict[str, float], list[dict]]:
        """Every eval set (eval.*) through the router at the policy the engines serve now: the metrics
        (`evaluation.evaluate`) and the samples as dicts. Reward failures count in the job's totals."""
        ro, ev = self.cfg.rollout, self.cfg.eval
        failures = Counter()

        def score(samples: list[Sample]) -> int:
            failed = self.reward.score(samples)
            failures["eval_reward_failures"] += failed
            return failed

        t0 = time.monotonic()
        metrics, samples = evaluate(
            self.eval_sets, router_url=self.fleet.router_url, api_key=self.fleet.api_key,
            params=self.sampling, samples_per_prompt=ev.samples_per_prompt, score=score,
            pass_threshold=ev.pass_threshold, max_concurrency=ro.max_concurrency, timeout_s=ro.request_timeout_s,
            tokenize=self._tokenize,
            detokenize=self._detokenize, program=self.program, policy_version=self.scheduler.engine_version)
        self.totals.update(failures)
        return {**metrics, "eval_reward_failures": failures["eval_reward_failures"],
                "time_eval_s": time.monotonic() - t0}, [s.to_dict() for s in samples]

    # ------------------------------------------------------------------ the engines' part of a weight sync
    def pause(self) -> None:
        """Before a weight sync: the watchdog stops probing generation, and (retract mode) generation pauses."""
        self.fleet.pause_probes()
        self.scheduler.pause()

    def engines_for_sync(self) -> dict:
        return self.fleet.for_sync()

    def engines_out(self, urls: list[str]) -> list[str]:
        return self.fleet.out_of_service(urls)

    def kill_hung(self, urls: list[str]) -> list[str]:
        return self.fleet.kill_hung(urls)

    def engines_lost(self, urls: list[str]) -> list[str]:
        return self.fleet.lost_after_failure(urls)

    def resume(self, *, policy_version: int, joined: list[str] = ()) -> None:
        """After a weight sync to `policy_version`: restarted engines that received it are routed to again, and
        (retract mode) retracted requests continue."""
        self.fleet.admit(joined)
        self.scheduler.resume(policy_version=policy_version)
        self.fleet.resume_probes()

    def release_memory(self, tags: list[str]) -> dict:
        return self.fleet.release_memory(tags)

    def resume_memory(self, tags: list[str]) -> dict:
        return self.fleet.resume_memory(tags)

    def state(self) -> dict:
        """What a resumed run needs so that no prompt is skipped or drawn twice: the prompt stream's position (the
        shuffle order is a function of run.seed and the epoch), the groups generated but not yet trained on (the
        partial-rollout buffer; see `RolloutScheduler.state`), and the cumulative sample-status counts."""
        return {"dataset": self.dataset.state(), "totals": dict(self.totals), "scheduler": self.scheduler.state()}

    def load_state(self, state: dict) -> None:
        """Restore `state()` into a started manager."""
        self.dataset.load_state(state["dataset"])
        self.totals = Counter(state.get("totals", {}))
        self.scheduler.load_state(state["scheduler"])

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.fleet.stop()
        if self.reward is not None:
            self.reward.close()


class ConfiguredRolloutManager(RolloutManager):
    """A `RolloutManager` whose parts `load_parts` loads from the config: what a job's Ray actor runs, so that they
    load in the actor's process (a tokenizer or a reward hook need not pickle)."""

    def __init__(self, cfg: JobConfig, *, log_dir: str, engine_options: list[list[dict]], api_key: str | None = None,
                 progress_bar: bool = False):
        super().__init__(cfg, **load_parts(cfg, log_dir=log_dir, engine_options=engine_options, api_key=api_key),
                         progress_bar=progress_bar)
