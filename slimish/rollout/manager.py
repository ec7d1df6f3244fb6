"""Rollout manager: owns the engines + router, the prompt stream and the reward hook; produces scored samples."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from slimish.config.schema import JobConfig
from slimish.hooks import load_function
from slimish.rollout import rewards
from slimish.rollout.data import PromptDataset
from slimish.rollout.generate import SamplingParams, generate_all
from slimish.rollout.servers import RolloutServers
from slimish.sample import Sample, Status


class RolloutManager:
    def __init__(self, cfg: JobConfig, *, log_dir: str):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.dataset = PromptDataset(cfg.data.path, tokenizer=self.tokenizer, prompt_key=cfg.data.prompt_key,
                                     label_key=cfg.data.label_key, shuffle=cfg.data.shuffle, seed=cfg.run.seed)
        self.reward_fn = load_function(cfg.reward.fn)
        self.servers = RolloutServers(rollout=cfg.rollout, model=cfg.model, log_dir=Path(log_dir),
                                      seed=cfg.run.seed)
        ro = cfg.rollout
        self.params = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p)
        self.totals = Counter()

    def start(self) -> dict:
        return {"time_engines_start_s": self.servers.start(), "engine_urls": self.servers.engine_urls,
                "router_url": self.servers.router_url, "pids": self.servers.pids()}

    def engine_urls(self) -> list[str]:
        return self.servers.engine_urls

    def rollout(self, step: int) -> tuple[list[Sample], dict]:
        """Sample `samples_per_prompt` responses for the next `prompts_per_step` prompts and score them."""
        ro = self.cfg.rollout
        t0 = time.monotonic()
        samples = [Sample(group_id=step * ro.prompts_per_step + g, index=i, prompt=p.text, prompt_ids=list(p.ids),
                          label=p.label)
                   for g, p in enumerate(self.dataset.next_batch(ro.prompts_per_step))
                   for i in range(ro.samples_per_prompt)]
        samples = asyncio.run(generate_all(self.servers.router_url, samples, self.params,
                                           max_concurrency=ro.max_concurrency, timeout_s=ro.request_timeout_s))
        time_generate = time.monotonic() - t0
        reward_failures = rewards.score(samples, self.reward_fn, failure_reward=self.cfg.reward.failure_reward)
        statuses = Counter(s.status.value for s in samples)
        self.totals.update(statuses)
        self.totals["reward_failures"] += reward_failures
        for sample in samples:
            if sample.status is not Status.FAILED:
                sample.check()
        n_tokens = sum(len(s.response_ids) for s in samples)
        trainable = [s for s in samples if s.trainable]
        metrics = {
            "reward_mean": sum(s.reward for s in trainable) / max(len(trainable), 1),
            "response_len_mean": n_tokens / max(len(samples), 1),
            "time_generate_s": time_generate,
            "generated_tokens": n_tokens,
            "reward_failures": reward_failures,
            **{f"samples_{status.value}": statuses.get(status.value, 0) for status in Status},
        }
        return samples, metrics

    def state(self) -> dict:
        """What a resumed run needs to draw the prompts the uninterrupted run would have drawn next (the shuffle
        order is a function of run.seed and the epoch), plus the cumulative sample-status counts."""
        return {"dataset": self.dataset.state(), "totals": dict(self.totals)}

    def load_state(self, state: dict) -> None:
        self.dataset.load_state(state["dataset"])
        self.totals = Counter(state.get("totals", {}))

    def shutdown(self) -> None:
        self.servers.stop()
