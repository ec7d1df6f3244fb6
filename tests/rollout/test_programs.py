"""Contract of a rollout program (`rollout.generate_fn`, slimish/rollout/programs.py), shown on the calculator task's
program against a scripted engine at the HTTP boundary (tests/kit/engines.py's `StandInEngine`; the e2e test runs it
on real engines): the model's tokens and logprobs are the engine's, trained; the environment's are inserted once,
never trained; an interrupted program is called again and picks up where it stopped; the budget covers both."""

from __future__ import annotations

import asyncio

import pytest

from slimish.rollout.generate import SamplingParams
from slimish.rollout.programs import Interrupted, RequestFailed, RolloutClient, single_turn
from slimish.sample import Sample, Status
from slimish.tasks import calculator
from tests.kit.engines import StandInEngine, generation_client, reply

VERSION = 3


def tokenize(text: str) -> list[int]:  # one id per character: easy to read back
    return [ord(c) for c in text]


def detokenize(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def scripted(replies: list[tuple[str, str]]) -> StandInEngine:
    """An engine whose /generate answers the next scripted (text, finish) in turn, with logprob -(position + 1) / 100
    per token; its `requests` are the bodies it was sent."""
    replies = list(replies)

    def answer(input_ids: list[int], sampling_params: dict) -> dict:
        text, finish = replies.pop(0)
        ids, start = tokenize(text), len(input_ids)
        return reply(ids, text=text, finish=finish, version=str(VERSION),
                     logprobs=[-(start + k + 1) / 100 for k in range(len(ids))])

    return StandInEngine(answer)


def run(program, sample: Sample, engine: StandInEngine, *, max_new_tokens: int = 40):
    async def go():
        engines = generation_client(engine)
        client = RolloutClient(engines=engines, rid="r", semaphore=asyncio.Semaphore(4),
                               params=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0),
                               max_retries=0, retry_delay_s=0, tokenize=tokenize, detokenize=detokenize,
                               policy_version=lambda: VERSION)
        try:
            return await program(sample, client)
        finally:
            await engines.aclose()
    return asyncio.run(go())


def new_sample() -> Sample:
    return Sample(group_id=0, index=0, prompt="add 3 4", prompt_ids=tokenize("add 3 4"), label="7")


def test_model_tokens_train_and_the_calculators_do_not():
    engine = scripted([("calc 3 4;", "stop"), (" answer 7", "stop")])
    sample = run(calculator.program, new_sample(), engine)
    assert detokenize(sample.response_ids) == "calc 3 4; = 7; answer 7" and sample.status is Status.COMPLETED
    model, env = len("calc 3 4;"), len(" = 7;")
    assert sample.loss_mask == [1] * model + [0] * env + [1] * len(" answer 7")
    assert sample.meta["environment_spans"] == [[model, model + env]]
    assert sample.rollout_logprobs[model:model + env] == [0.0] * env
    # every trained token and logprob is the engine's, as it sent them; the second turn saw the calculator's reply
    prompt = len(sample.prompt_ids)
    trained = [(t, lp) for t, lp, m in zip(sample.response_ids, sample.rollout_logprobs, sample.loss_mask) if m]
    sent = [(t, -(prompt + k + 1) / 100) for k, t in enumerate(tokenize("calc 3 4;"))] + \
        [(t, -(prompt + model + env + k + 1) / 100) for k, t in enumerate(tokenize(" answer 7"))]
    assert trained == sent
    assert engine.requests[1]["input_ids"] == sample.prompt_ids + tokenize("calc 3 4; = 7;")
    assert engine.requests[1]["sampling_params"]["max_new_tokens"] == 40 - model - env
    assert engine.requests[0]["sampling_params"]["stop"] == [";"]
    assert sample.weight_versions == [VERSION] * len(sample.response_ids)
    assert calculator.reward([detokenize(sample.response_ids)], ["7"]) == [1.0]


def test_an_interrupted_program_is_called_again_and_picks_up_where_it_stopped():
    engine = scripted([("calc 3 4;", "stop"), (" ans", "abort"), ("wer 7", "stop")])
    sample = new_sample()
    with pytest.raises(Interrupted):
        run(calculator.program, sample, engine)
    assert sample.status is Status.ABORTED and detokenize(sample.response_ids) == "calc 3 4; = 7; ans"
    sample.status = Status.PENDING  # as the scheduler resubmits it
    run(calculator.program, sample, engine)
    assert detokenize(sample.response_ids) == "calc 3 4; = 7; answer 7", "the calculator answered once"
    assert sample.loss_mask.count(0) == len(" = 7;") and sample.status is Status.COMPLETED


def test_the_budget_covers_model_and_environment_tokens():
    engine = scripted([("calc 3 4;", "stop")])
    sample = run(calculator.program, new_sample(), engine, max_new_tokens=12)
    assert detokenize(sample.response_ids) == "calc 3 4; = " and sample.status is Status.TRUNCATED
    assert len(engine.requests) == 1, "no request for a budget already spent"


def test_a_direct_answer_gets_no_environment_turn_and_a_failed_request_raises():
    sample = run(calculator.program, new_sample(), scripted([("answer 9", "stop")]))
    assert sample.loss_mask == [1] * len("answer 9") and "environment_spans" not in sample.meta
    assert calculator.reward([detokenize(sample.response_ids)], ["7"]) == [0.0]
    with pytest.raises(RequestFailed, match="HTTP 400"):
        run(single_turn, new_sample(), StandInEngine(refuse=400))
