"""A reward service over HTTP (`reward.url`), called like a local reward hook.

Protocol: POST the URL with a JSON object {"completions": [...], "prompts": [...], "labels": [...], <column>: [...]}
(the same keywords a local hook gets, except `samples`) for up to `batch_size` completions; the answer is
{"rewards": [float, ...]}, one per completion. Requests run `max_concurrency` at a time; a connection failure, a
timeout or a 5xx answer is retried `retries` times (backoff 0.5 s, doubling); anything else, or the last failure,
raises, and `slimish.rollout.rewards.score` counts the failure like a local hook's.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

BACKOFF_S = 0.5


class RemoteRewardError(RuntimeError):
    pass


class RemoteReward:
    def __init__(self, url: str, *, max_concurrency: int, retries: int, timeout_s: float, batch_size: int):
        self.url, self.retries, self.batch_size = url, retries, batch_size
        self.client = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=max_concurrency))
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="remote-reward")

    def __call__(self, completions: list[str], **kwargs) -> list[float]:
        kwargs.pop("samples", None)
        chunks = []
        for first in range(0, len(completions), self.batch_size):
            part = slice(first, first + self.batch_size)
            chunks.append({"completions": completions[part], **{k: v[part] for k, v in kwargs.items()}})
        rewards = []
        for answer in self.pool.map(self._post, chunks):
            rewards += answer
        return rewards

    def _post(self, payload: dict) -> list[float]:
        for attempt in range(self.retries + 1):
            try:
                response = self.client.post(self.url, json=payload)
                if response.status_code < 500:
                    response.raise_for_status()
                    rewards = response.json().get("rewards")
                    if not isinstance(rewards, list) or len(rewards) != len(payload["completions"]):
                        raise RemoteRewardError(f"{self.url} answered {response.text[:200]!r}; expected "
                                                f"{{\"rewards\": [...]}} with {len(payload['completions'])} values")
                    return [float(r) for r in rewards]
                failure = f"HTTP {response.status_code}"
            except httpx.TransportError as exc:  # connection refused or reset, timeout
                failure = f"{type(exc).__name__}: {exc}"
            if attempt < self.retries:
                time.sleep(BACKOFF_S * 2 ** attempt)
        raise RemoteRewardError(f"{self.url}: {failure} after {self.retries + 1} attempts (reward.retries)")

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.client.close()
