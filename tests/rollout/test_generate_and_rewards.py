"""Engine reply -> Sample, and reward-hook failure containment (no server: the reply is one recorded from
sglang 0.5.23 on CPU; the real path is covered by tests/e2e)."""

from __future__ import annotations

import threading

import pytest

from slimish.rollout import rewards
from slimish.rollout.generate import (
    SamplingParams,
    append_reply,
    finish_multi_segment,
    per_token_versions,
    request_body,
)
from slimish.sample import Sample, Status
from tests.kit import samples as kit
from tests.kit.engines import StandInEngine, generation_client

RECORDED_REPLY = {
    "text": "7", "output_ids": [23, 0],
    "meta_info": {"finish_reason": {"type": "stop", "matched": 0}, "prompt_tokens": 3, "weight_version": "4",
                  "num_retractions": 0, "output_token_logprobs": [[-0.52, 23, None], [-0.01, 0, None]],
                  "completion_tokens": 2, "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                                              {"version": "4", "start": 1, "end": 2}]},
}


SAY_7 = {"prompt": "say 7", "prompt_ids": [269, 221, 23], "label": "7"}  # `_sample`'s, for tests/kit/samples.py


def _sample(**kw) -> Sample:
    return Sample(group_id=0, index=0, prompt="say 7", prompt_ids=[269, 221, 23], label="7", **kw)


def test_reply_fills_tokens_logprobs_versions():
    s = append_reply(_sample(), RECORDED_REPLY)
    assert s.response_ids == [23, 0] and s.rollout_logprobs == [-0.52, -0.01]
    assert s.weight_versions == [3, 4] and s.loss_mask == [1, 1]
    assert s.status is Status.COMPLETED and s.trainable
    s.check()


@pytest.mark.parametrize("finish,status", [("length", Status.TRUNCATED), ("abort", Status.ABORTED)])
def test_finish_reasons(finish, status):
    reply = {**RECORDED_REPLY, "meta_info": {**RECORDED_REPLY["meta_info"], "finish_reason": {"type": finish}}}
    assert append_reply(_sample(), reply).status is status


def test_mismatched_logprobs_are_rejected_and_leave_sample_untouched():
    reply = {**RECORDED_REPLY, "output_ids": [23, 5]}
    s = _sample()
    with pytest.raises(ValueError):
        append_reply(s, reply)
    assert s.response_ids == [] and s.rollout_logprobs == []


ABORTED_REPLY = {"text": "", "output_ids": [],
                 "meta_info": {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                               "weight_version": "4"}}


def test_partial_response_is_continued_and_appended():
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0)
    aborted = {**RECORDED_REPLY, "meta_info": {**RECORDED_REPLY["meta_info"], "finish_reason": {"type": "abort"},
                                               "num_retractions": 1}}
    s = append_reply(_sample(), aborted)
    assert s.status is Status.ABORTED and not s.trainable and s.response_ids == [23, 0]
    body = request_body(s, params, rid="r")
    assert body["input_ids"] == [269, 221, 23, 23, 0]  # prompt + partial response, as token ids
    assert body["sampling_params"]["max_new_tokens"] == 6 and body["return_logprob"] is True
    s = append_reply(s, RECORDED_REPLY)
    assert s.response_ids == [23, 0, 23, 0] and s.rollout_logprobs == [-0.52, -0.01, -0.52, -0.01]
    assert s.weight_versions == [3, 4, 3, 4] and s.loss_mask == [1] * 4
    assert s.status is Status.COMPLETED and s.meta == {"num_retractions": 1, "segments": 2}
    s.check()


def _two_segments(first: str, second: str, status: Status) -> Sample:
    """A response of one character per token, generated in two requests."""
    ids = [ord(c) for c in first + second]
    return kit.sample(response_ids=ids, rollout_logprobs=-0.5, weight_versions=[3] * len(first) + [4] * len(second),
                      status=status, meta={"segments": 2}, **SAY_7)


def _chars(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_stop_string_split_across_two_requests_ends_the_response():
    sample = _two_segments("x = 2 </ans", "wer> and more </answer>", Status.TRUNCATED)
    finish_multi_segment(sample, ("</answer>",), _chars)
    assert _chars(sample.response_ids) == "x = 2 </answer>", "cut after the token completing the stop string"
    assert sample.response == "x = 2 " and sample.status is Status.COMPLETED
    assert sample.weight_versions == [3] * 11 + [4] * 4
    sample.check()


def test_multi_segment_text_without_a_split_stop_string_is_the_whole_decode():
    sample = _two_segments("abc", "def</answer>", Status.COMPLETED)  # the engine stopped in the second request
    finish_multi_segment(sample, ("</answer>",), _chars)
    assert _chars(sample.response_ids) == "abcdef</answer>" and sample.response == "abcdef"
    sample = _two_segments("abc", "def", Status.TRUNCATED)
    finish_multi_segment(sample, ("</answer>",), _chars)
    assert sample.response == "abcdef" and sample.status is Status.TRUNCATED and len(sample.response_ids) == 6


def test_abort_before_the_first_token_appends_nothing():
    s = append_reply(_sample(), ABORTED_REPLY)
    assert s.status is Status.ABORTED and s.response_ids == [] and s.meta["segments"] == 1


def test_sample_round_trips_through_its_dict():
    from slimish.sample import Sample

    s = append_reply(_sample(), RECORDED_REPLY)
    assert Sample.from_dict(s.to_dict()) == s
    s.restart()
    assert s.status is Status.PENDING and s.response_ids == [] and s.meta == {}


def test_startup_version_default_is_zero():
    assert per_token_versions({"weight_version": "default"}, 3) == [0, 0, 0]


def _scored(texts):
    return [kit.sample(response=t, **SAY_7) for t in texts]


def test_reward_hook_contract():
    from slimish.tasks.echo_digit import reward

    samples = _scored(["7", "3", " 7 and more", ""])
    assert rewards.score(samples, reward, failure_reward=0.0) == 0
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0]


def test_failing_reward_only_fails_the_bad_samples():
    def flaky(completions, **kwargs):
        if any("boom" in c for c in completions):
            raise RuntimeError("reward service down")
        return [1.0] * len(completions)

    samples = _scored(["7", "boom", "7"])
    assert rewards.score(samples, flaky, failure_reward=-1.0) == 1
    assert [s.reward for s in samples] == [1.0, -1.0, 1.0]
    assert "reward service down" in samples[1].error


def test_wrong_length_reward_is_a_failure():
    samples = _scored(["7", "7"])
    assert rewards.score(samples, lambda c, **k: [1.0], failure_reward=0.0) == 2


def test_reward_hook_past_its_time_limit_fails_its_samples_and_is_abandoned():
    release = threading.Event()

    def stuck(completions, **kwargs):
        release.wait()  # a hook that never answers (until the test lets it go)
        return [1.0] * len(completions)

    samples = _scored(["7", "7"])
    try:
        assert rewards.score(samples, stuck, failure_reward=-1.0, timeout_s=0.5) == 2
    finally:
        release.set()
    assert [s.reward for s in samples] == [-1.0, -1.0] and "reward.timeout_s" in samples[0].error

    samples = _scored(["7", "3"])
    from slimish.tasks.echo_digit import reward

    assert rewards.score(samples, reward, failure_reward=-1.0, timeout_s=60) == 0  # in time: as without a limit
    assert [s.reward for s in samples] == [1.0, 0.0] and samples[0].error == ""


def test_split_stop_string_with_the_models_tokenizer(task_assets):
    """The same with the tiny model's real tokenizer: the split falls inside the stop string's tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task_assets["model"])
    detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731 - as the manager's
    head = tokenizer("say 7 7 </an")["input_ids"]
    ids = head + tokenizer("swer> 7 7 </answer>")["input_ids"]
    assert detokenize(ids) == "say 7 7 </answer> 7 7 </answer>"
    sample = kit.sample(response_ids=ids, rollout_logprobs=-0.5, status=Status.TRUNCATED, meta={"segments": 2},
                        **SAY_7)
    finish_multi_segment(sample, ("</answer>",), detokenize)
    assert detokenize(sample.response_ids) == "say 7 7 </answer>" and sample.response == "say 7 7 "
    assert len(head) < len(sample.response_ids) < len(ids) and sample.status is Status.COMPLETED
    sample.check()


def test_an_abort_on_the_last_token_of_the_budget_is_a_truncation():
    """Nothing is left to continue (a continuation would ask for max_new_tokens=0): the sample is truncated and
    trains. The engine is tests/kit/engines.py's stand-in, answering the recorded reply with finish 'abort'."""
    import asyncio

    from slimish.rollout.generate import generate_one

    aborted = {**RECORDED_REPLY, "meta_info": {**RECORDED_REPLY["meta_info"], "finish_reason": {"type": "abort"}}}
    engine = StandInEngine(lambda input_ids, sampling_params: aborted)

    async def generate(max_new_tokens: int) -> Sample:
        engines = generation_client(engine)
        try:
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0)
            return await generate_one(engines, _sample(), params, rid="r")
        finally:
            await engines.aclose()

    assert asyncio.run(generate(2)).status is Status.TRUNCATED
    assert asyncio.run(generate(3)).status is Status.ABORTED


def test_a_batched_request_fills_each_sample_or_none():
    """Several samples with the same budget go in one request (input_ids batched, answered in order); a reply list
    with one malformed entry changes no sample. The engine is tests/kit/engines.py's stand-in."""
    import asyncio

    from slimish.engines.generation import RequestError
    from slimish.rollout.generate import batch_body, generate_batch

    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0)
    truncated = {**RECORDED_REPLY, "meta_info": {**RECORDED_REPLY["meta_info"], "finish_reason": {"type": "length"}}}
    bodies = []

    def run(replies: list[dict]) -> list[Sample]:
        engine = StandInEngine(replies=replies)

        async def go():
            samples = [_sample(), Sample(group_id=0, index=1, prompt="say 7", prompt_ids=[269, 221, 23], label="7")]
            engines = generation_client(engine)
            try:
                await generate_batch(engines, samples, params, rid="g")
            except RequestError:
                pass
            finally:
                await engines.aclose()
            return samples
        samples = asyncio.run(go())
        bodies.extend(engine.requests)
        return samples

    first, second = run([RECORDED_REPLY, truncated])
    assert bodies[0]["input_ids"] == [[269, 221, 23], [269, 221, 23]] and bodies[0]["rid"] == "g"
    assert bodies[0]["sampling_params"]["max_new_tokens"] == 8
    assert (first.status, second.status) == (Status.COMPLETED, Status.TRUNCATED)
    assert first.response_ids == second.response_ids == [23, 0]
    untouched = run([RECORDED_REPLY, {**RECORDED_REPLY, "output_ids": [23, 5]}])
    assert all(s.response_ids == [] and s.status is Status.PENDING for s in untouched)
    continued = append_reply(_sample(), {**RECORDED_REPLY, "meta_info": {**RECORDED_REPLY["meta_info"],
                                                                         "finish_reason": {"type": "abort"}}})
    with pytest.raises(ValueError, match="share a token budget"):
        batch_body([continued, _sample()], params, rid="g")


def test_a_non_finite_reward_fails_its_own_sample():
    """inf (and NaN) is a failure of the completion it was returned for, never a value: on main at a706c6e inf passed
    as a reward and made its GRPO group's advantages NaN, and NaN failed the whole batch."""
    samples = _scored(["7", "inf", "nan", "3"])
    values = {"7": 1.0, "inf": float("inf"), "nan": float("nan"), "3": -float("inf")}
    assert rewards.score(samples, lambda completions, **k: [values[c] for c in completions], failure_reward=-1.0) == 3
    assert [s.reward for s in samples] == [1.0, -1.0, -1.0, -1.0]
    assert samples[1].error == "reward failed: NonFiniteReward: reward fn returned inf for this completion"
    assert "returned nan" in samples[2].error and "returned -inf" in samples[3].error and samples[0].error == ""
