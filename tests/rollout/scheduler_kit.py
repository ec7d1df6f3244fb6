"""What the scheduler tests share: one way to build a scheduler (against a real engine in
tests/e2e/test_scheduler_engine.py, a stand-in in test_scheduler_logic.py), the groups it is given, and the checks
of a handed-out batch."""

from __future__ import annotations

from slimish.config.schema import DynamicSamplingConfig, PartialRolloutConfig
from slimish.engines.generation import GenerationClient
from slimish.rollout.generate import SamplingParams
from slimish.rollout.scheduler import RolloutScheduler
from slimish.sample import Sample, Status

GROUP = 4
MAX_NEW_TOKENS = 200


def reward_by_length(samples: list[Sample]) -> int:
    for sample in samples:
        sample.reward = float(len(sample.response_ids))
    return 0


def make_scheduler(url: str, mode: str, *, over_sampling: int = 2, max_staleness: int = 0,
                   max_concurrency: int = 64, stop: tuple[str, ...] = (), score=reward_by_length,
                   dynamic_sampling: DynamicSamplingConfig | None = None, program=None,
                   transport=None, api_key: str | None = None) -> RolloutScheduler:
    """A scheduler of 4 groups a step on the engine at `url` (`transport`: a stand-in engine answering there,
    tests/kit/engines.py's `StandInEngine.transport()`), which requires `api_key` if given."""
    def new_group(group_id: int) -> list[Sample]:
        return [Sample(group_id=group_id, index=i, prompt="", prompt_ids=[5, 6, 7, 10 + group_id % 50])
                for i in range(GROUP)]

    engines = GenerationClient(url, request_timeout_s=120, max_concurrency=max_concurrency, api_key=api_key,
                               transport=transport)
    return RolloutScheduler(engines=engines, engine_urls=[url],
                            params=SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, stop=stop),
                            prompts_per_step=4, partial=PartialRolloutConfig(mode=mode, over_sampling=over_sampling,
                                                                              max_staleness=max_staleness),
                            max_concurrency=max_concurrency, max_retries=2, new_group=new_group, score=score,
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
