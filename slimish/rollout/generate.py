"""Generate through the router with `input_ids` + `return_logprob`, turning each engine reply into a `Sample`.

Response token ids and logprobs are taken from the engine's reply (`output_ids`, `meta_info.output_token_logprobs`)
and never re-tokenised; the decoded `text` is only used for the reward.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import httpx

from slimish.sample import Sample, Status


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float
    top_p: float

    def to_json(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}


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


def fill_from_reply(sample: Sample, reply: dict) -> Sample:
    """Copy the engine's tokens, logprobs, versions and finish reason into `sample` (all or nothing)."""
    meta = reply["meta_info"]
    ids = [int(t) for t in reply["output_ids"]]
    triples = meta.get("output_token_logprobs") or []
    if len(triples) != len(ids):
        raise ValueError(f"engine returned {len(ids)} tokens but {len(triples)} logprobs")
    for (_, token_id, *_), out_id in zip(triples, ids):
        if token_id != out_id:
            raise ValueError(f"logprob token {token_id} != output token {out_id}")
    versions = per_token_versions(meta, len(ids))
    finish = (meta.get("finish_reason") or {}).get("type")
    status = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}.get(finish)
    if status is None:
        raise ValueError(f"unexpected finish_reason {meta.get('finish_reason')!r}")
    sample.response_ids, sample.response = ids, reply.get("text", "")
    sample.rollout_logprobs = [float(t[0]) for t in triples]
    sample.weight_versions, sample.loss_mask = versions, [1] * len(ids)
    sample.status = status
    sample.meta["num_retractions"] = meta.get("num_retractions", 0)
    return sample


async def generate_one(http: httpx.AsyncClient, url: str, sample: Sample, params: SamplingParams,
                       semaphore: asyncio.Semaphore, rid: str) -> Sample:
    body = {"input_ids": sample.prompt_ids, "sampling_params": params.to_json(), "return_logprob": True,
            "rid": rid}
    async with semaphore:
        try:
            resp = await http.post(f"{url}/generate", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            return fill_from_reply(sample, resp.json())
        except Exception as exc:  # one bad request must not sink the batch: mark, count, move on
            sample.status, sample.error = Status.FAILED, f"{type(exc).__name__}: {exc}"
            return sample


async def generate_all(url: str, samples: list[Sample], params: SamplingParams, *, max_concurrency: int,
                       timeout_s: float) -> list[Sample]:
    semaphore = asyncio.Semaphore(max_concurrency)
    prefix = uuid.uuid4().hex[:8]
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        return await asyncio.gather(*[
            generate_one(http, url, s, params, semaphore, rid=f"slimish-{prefix}-{s.group_id}-{s.index}")
            for s in samples])
