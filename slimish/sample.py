"""`Sample`: the one record that travels from the engine to the loss.

Token ids and logprobs are exactly what the engine returned (never re-tokenised). Per-token lists
(`response_ids`, `rollout_logprobs`, `weight_versions`, `loss_mask`) always have the same length.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(enum.StrEnum):
    COMPLETED = "completed"   # the engine stopped on EOS / a stop token
    TRUNCATED = "truncated"   # hit max_new_tokens
    ABORTED = "aborted"       # aborted by us (partial rollout / shutdown); may be resumed
    FAILED = "failed"         # the engine or the request failed; never trained on


@dataclass(kw_only=True)
class Sample:
    group_id: int
    index: int                       # position within its group
    prompt: str
    prompt_ids: list[int]
    label: Any = None
    response: str = ""
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    status: Status = Status.COMPLETED
    error: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def trainable(self) -> bool:
        return self.status in (Status.COMPLETED, Status.TRUNCATED) and len(self.response_ids) > 0

    def check(self) -> None:
        n = len(self.response_ids)
        lengths = (len(self.rollout_logprobs), len(self.weight_versions), len(self.loss_mask))
        if any(length != n for length in lengths):
            raise ValueError(f"sample {self.group_id}/{self.index}: per-token lists differ in length: "
                             f"ids={n} logprobs/versions/mask={lengths}")
