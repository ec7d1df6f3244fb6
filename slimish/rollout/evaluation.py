"""Evaluation during training: held-out prompts, `samples_per_prompt` samples each, generated through the router on
the job's engines at the policy they serve now, scored by the job's reward, never trained on.

A sample passes when its reward reaches `eval.pass_threshold`. pass@j is the unbiased estimator of Chen et al.
(2021): with n samples of a prompt of which c pass, 1 - C(n - c, j) / C(n, j), averaged over the prompts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from math import comb
from pathlib import Path

from slimish.engines.generation import GenerationClient
from slimish.rollout.data import PromptDataset
from slimish.rollout.generate import SamplingParams, finish_multi_segment
from slimish.rollout.programs import Interrupted, RolloutClient, single_turn
from slimish.sample import Sample, Status

logger = logging.getLogger(__name__)

RETRIES = 2  # per request whose engine may have died (connection error, 5xx): the router picks another
RETRY_DELAY_S = 1.0


def pass_at(n: int, c: int, j: int) -> float:
    """The probability that at least one of j samples drawn without replacement from n, c of them passing, passes."""
    if n - c < j:
        return 1.0
    return 1.0 - comb(n - c, j) / comb(n, j)


class EvalSet:
    """One held-out prompt file, named by its file stem; the first `max_prompts` prompts (0: all)."""

    def __init__(self, path: str, *, tokenizer, prompt_key: str, label_key: str, chat_template: bool,
                 max_prompts: int):
        self.name = Path(path.rstrip("/")).stem
        prompts = PromptDataset(path, tokenizer=tokenizer, prompt_key=prompt_key, label_key=label_key, shuffle=False,
                                seed=0, chat_template=chat_template).prompts
        self.prompts = prompts[:max_prompts] if max_prompts > 0 else prompts


def evaluate(sets: list[EvalSet], *, router_url: str, api_key: str | None, params: SamplingParams,
             samples_per_prompt: int, score: Callable[[list[Sample]], int], pass_threshold: float,
             max_concurrency: int, timeout_s: float, tokenize: Callable[[str], list[int]],
             detokenize: Callable[[list[int]], str], program: Callable | None = None,
             policy_version: int = 0) -> tuple[dict[str, float], list[Sample]]:
    """Metrics `eval/<set>/{pass@1, pass@k, reward_mean, response_len_mean, samples_failed}` and the scored
    samples (group_id: the prompt's index in its set; meta["eval_set"]: the set's name). Each sample goes through
    the job's rollout program (`rollout.generate_fn`; one generation without one), as training samples do. A
    sample whose request or program failed is scored as failing and counted."""
    samples = {s.name: [Sample(group_id=g, index=i, prompt=p.text, prompt_ids=list(p.ids), label=p.label,
                               columns=p.columns, meta={"eval_set": s.name})
                        for g, p in enumerate(s.prompts) for i in range(samples_per_prompt)] for s in sets}
    everything = [sample for group in samples.values() for sample in group]
    t0 = time.monotonic()
    failed = asyncio.run(_generate(everything, router_url=router_url, api_key=api_key, params=params,
                                   max_concurrency=max_concurrency, timeout_s=timeout_s, program=program,
                                   tokenize=tokenize, detokenize=detokenize, policy_version=policy_version))
    generated = [s for s in everything if id(s) not in failed]
    for sample in generated:
        if program is not None:  # as the scheduler does: a program's response is its decoded transcript
            sample.response = detokenize(sample.response_ids)
        elif sample.meta.get("segments", 0) > 1:  # continued after an abort: decode the whole response
            finish_multi_segment(sample, params.stop, detokenize)
    if generated:
        score(generated)
    metrics: dict[str, float] = {"time_eval_generate_s": time.monotonic() - t0}
    k = samples_per_prompt
    for name, group in samples.items():
        passes = [0] * (len(group) // k)
        for sample in group:
            ok = id(sample) not in failed and sample.reward is not None and sample.reward >= pass_threshold
            passes[sample.group_id] += int(ok)
        scored = [s for s in group if id(s) not in failed]
        metrics[f"eval/{name}/pass@1"] = sum(pass_at(k, c, 1) for c in passes) / max(len(passes), 1)
        metrics[f"eval/{name}/pass@{k}"] = sum(pass_at(k, c, k) for c in passes) / max(len(passes), 1)
        metrics[f"eval/{name}/reward_mean"] = sum(s.reward for s in scored) / max(len(scored), 1)
        metrics[f"eval/{name}/response_len_mean"] = sum(len(s.response_ids) for s in scored) / max(len(scored), 1)
        metrics[f"eval/{name}/samples_failed"] = len(group) - len(scored)
    return metrics, everything


async def _generate(samples: list[Sample], *, router_url: str, api_key: str | None, params: SamplingParams,
                    max_concurrency: int, timeout_s: float, program: Callable | None, tokenize: Callable,
                    detokenize: Callable, policy_version: int) -> set[int]:
    """Run every sample to its end (an interrupted one is continued: nothing pauses evaluation, but an engine may
    abort); the ids of those whose requests or program failed for good."""
    semaphore = asyncio.Semaphore(max_concurrency)
    prefix = f"eval-{uuid.uuid4().hex[:8]}"
    failed: set[int] = set()
    engines = GenerationClient(router_url, request_timeout_s=timeout_s, max_concurrency=max_concurrency,
                               api_key=api_key)
    try:
        async def one(n: int, sample: Sample) -> None:
            client = RolloutClient(engines=engines, params=params, semaphore=semaphore, rid=f"{prefix}-{n}",
                                   max_retries=RETRIES, retry_delay_s=RETRY_DELAY_S, tokenize=tokenize,
                                   detokenize=detokenize, policy_version=lambda: policy_version)
            for _ in range(RETRIES + 1):
                try:
                    await (program or single_turn)(sample, client)
                    return
                except Interrupted:
                    sample.status = Status.PENDING
                except Exception as exc:  # RequestFailed, or the program's own error: the sample fails, counted
                    logger.warning("evaluation sample %s/%s failed: %s: %s", sample.meta["eval_set"],
                                   sample.group_id, type(exc).__name__, exc)
                    break
            failed.add(id(sample))

        await asyncio.gather(*(one(n, s) for n, s in enumerate(samples)))
    finally:
        await engines.aclose()
    return failed
