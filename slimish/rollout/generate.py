"""/generate requests through the router (`slimish.engines.generation`) with `input_ids` + `return_logprob`, each
reply appended to its `Sample`.
A request carries one sample, or several that share a token budget (SGLang's batched input, answered as a list in
the same order): one request per GRPO group reaches the engine at once, rather than as many scattered arrivals,
each of which the engine would schedule in a batch of its own.

Response token ids and logprobs are taken from the engine's reply (`output_ids`, `meta_info.output_token_logprobs`)
and never re-tokenised; the decoded `text` is only used for the reward. A sample that already holds a partial
response (aborted earlier) is continued: the request's input is prompt + partial response, its token budget what
is left of `max_new_tokens`, and the reply is appended.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimish.engines.generation import GenerationClient, RequestError
from slimish.sample import Sample, Status


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...] = ()

    def to_json(self) -> dict:
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}
        if self.stop:
            params["stop"] = list(self.stop)
        return params


def as_version(raw) -> int:
    """Engine weight version as an int; the engine's startup version ("default") is version 0."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


def _version_of(span) -> tuple[int, int, int]:
    if isinstance(span, dict):
        return as_version(span["version"]), int(span["start"]), int(span["end"])
    version, start, end = span
    return as_version(version), int(start), int(end)


def per_token_versions(meta: dict, num_tokens: int) -> list[int]:
    """Weight version of every output token, from `meta_info.weight_versions` spans (else the reply's version)."""
    spans = meta.get("weight_versions")
    default = as_version(meta.get("weight_version"))
    versions = [default] * num_tokens
    for span in spans or []:
        version, start, end = _version_of(span)
        for i in range(max(start, 0), min(end, num_tokens)):
            versions[i] = version
    return versions


FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def request_body(sample: Sample, params: SamplingParams, rid: str) -> dict:
    """The /generate body for `sample`: its prompt, plus its partial response when it is being continued."""
    sampling = params.to_json()
    sampling["max_new_tokens"] = params.max_new_tokens - len(sample.response_ids)
    return {"input_ids": sample.prompt_ids + sample.response_ids, "sampling_params": sampling,
            "return_logprob": True, "rid": rid}


def batch_body(samples: list[Sample], params: SamplingParams, rid: str) -> dict:
    """The /generate body for `samples`, which have the same number of response tokens left to generate. SGLang
    names the requests `{rid}_{i}`."""
    budgets = {params.max_new_tokens - len(s.response_ids) for s in samples}
    if len(budgets) != 1:
        raise ValueError(f"one request's samples must share a token budget, got {sorted(budgets)}")
    body = request_body(samples[0], params, rid)
    body["input_ids"] = [s.prompt_ids + s.response_ids for s in samples]
    return body


def _checked(reply: dict) -> tuple[Status, list[int], list, dict]:
    """`reply`'s status, token ids, logprob triples and meta_info, after checking they agree (ValueError)."""
    meta = reply["meta_info"]
    finish = (meta.get("finish_reason") or {}).get("type")
    status = FINISH_STATUS.get(finish)
    if status is None:
        raise ValueError(f"unexpected finish_reason {meta.get('finish_reason')!r}")
    ids = [int(t) for t in reply.get("output_ids") or []]
    triples = meta.get("output_token_logprobs") or []
    if len(triples) != len(ids):
        raise ValueError(f"engine returned {len(ids)} tokens but {len(triples)} logprobs")
    for (_, token_id, *_), out_id in zip(triples, ids):
        if token_id != out_id:
            raise ValueError(f"logprob token {token_id} != output token {out_id}")
    return status, ids, triples, meta


def append_reply(sample: Sample, reply: dict) -> Sample:
    """Append the engine's tokens, logprobs and versions to `sample` and take its finish reason (all or nothing).

    An aborted request may end before the engine produced any token; it then appends nothing."""
    return _append(sample, reply, *_checked(reply))


def _append(sample: Sample, reply: dict, status: Status, ids: list[int], triples: list, meta: dict) -> Sample:
    sample.response = sample.response + reply.get("text", "") if sample.response_ids else reply.get("text", "")
    sample.response_ids = sample.response_ids + ids
    sample.rollout_logprobs = sample.rollout_logprobs + [float(t[0]) for t in triples]
    sample.weight_versions = sample.weight_versions + per_token_versions(meta, len(ids))
    sample.loss_mask = sample.loss_mask + [1] * len(ids)
    sample.status = status
    sample.meta["num_retractions"] = sample.meta.get("num_retractions", 0) + int(meta.get("num_retractions") or 0)
    sample.meta["segments"] = sample.meta.get("segments", 0) + 1
    return sample


def finish_multi_segment(sample: Sample, stop: tuple[str, ...], detokenize) -> None:
    """Set the text of a response generated in several requests (partial rollouts) from all its tokens, as one
    request would have: a stop string split across two requests, which no engine saw whole, ends it after the
    token that completes the earliest one (tokens kept, as the engine keeps a stop string's tokens; the text cut
    before it, as the engine cuts it), and the sample is completed. `detokenize(ids) -> str`."""
    text = detokenize(sample.response_ids)
    found = [(text.find(s), s) for s in stop if s in text]
    if not found:
        sample.response = text
        return
    begin, matched = min(found)
    target = text[:begin + len(matched)]
    lo, hi = 1, len(sample.response_ids)  # the shortest token prefix whose text contains that stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if detokenize(sample.response_ids[:mid]).startswith(target):
            hi = mid
        else:
            lo = mid + 1
    sample.response_ids, sample.rollout_logprobs = sample.response_ids[:lo], sample.rollout_logprobs[:lo]
    sample.weight_versions, sample.loss_mask = sample.weight_versions[:lo], sample.loss_mask[:lo]
    sample.response, sample.status = text[:begin], Status.COMPLETED


async def generate_one(client: GenerationClient, sample: Sample, params: SamplingParams, *, rid: str) -> Sample:
    """Generate (or continue) `sample` through the router and append the reply; raises `RequestError` (the sample
    unchanged) if the request fails."""
    await _post(client, [sample], params, request_body(sample, params, rid))
    return sample


async def generate_batch(client: GenerationClient, samples: list[Sample], params: SamplingParams, *,
                         rid: str) -> list[Sample]:
    """`generate_one` for several samples that share a token budget, in one request: each reply is appended to its
    sample; if the request fails, `RequestError` is raised and every sample is unchanged."""
    await _post(client, samples, params, batch_body(samples, params, rid))
    return samples


async def _post(client: GenerationClient, samples: list[Sample], params: SamplingParams, body: dict) -> None:
    replies = await client.generate(body)
    try:
        replies = replies if isinstance(body["input_ids"][0], list) else [replies]
        if len(replies) != len(samples):
            raise ValueError(f"{len(replies)} replies to {len(samples)} inputs")
        checked = [_checked(reply) for reply in replies]  # every reply, before any sample changes
    except (ValueError, KeyError, TypeError) as exc:
        raise RequestError(f"malformed reply: {type(exc).__name__}: {exc}", retriable=False) from exc
    for sample, reply, parts in zip(samples, replies, checked):
        _append(sample, reply, *parts)
        if sample.status is Status.ABORTED and len(sample.response_ids) >= params.max_new_tokens:
            # The abort landed on the last token of the budget: nothing is left to continue (a continuation would
            # ask for max_new_tokens=0).
            sample.status = Status.TRUNCATED
