"""`Sample`: the one record that travels from the engine to the loss.

Token ids and logprobs are exactly what the engine returned (never re-tokenised). Per-token lists
(`response_ids`, `rollout_logprobs`, `weight_versions`, `loss_mask`) always have the same length. A sample aborted
mid-generation keeps its tokens and is continued later from prompt + partial response (partial rollout), so one
response can span several requests and weight versions (`meta["segments"]` counts the requests).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class Status(enum.StrEnum):
    PENDING = "pending"       # not generated yet, or being generated
    COMPLETED = "completed"   # the engine stopped on EOS / a stop token
    TRUNCATED = "truncated"   # hit max_new_tokens
    ABORTED = "aborted"       # aborted by us (partial rollout / shutdown) with its tokens so far; to be continued
    FAILED = "failed"         # the engine or the request failed; never trained on


FINISHED = (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)


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
    status: Status = Status.PENDING
    error: str = ""
    excluded: str = ""               # why a scored sample is kept out of the loss ("overlong"); "" = it trains
    meta: dict = field(default_factory=dict)
    columns: dict = field(default_factory=dict)  # its prompt's dataset row (every column), for the reward hook

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def scored(self) -> bool:
        """Its generation ended normally with tokens: it gets a reward, which counts in its group's baseline."""
        return self.status in (Status.COMPLETED, Status.TRUNCATED) and len(self.response_ids) > 0

    @property
    def trainable(self) -> bool:
        """The one place that decides whether a sample trains: it is scored and not excluded from the loss."""
        return self.scored and not self.excluded

    @property
    def train_mask(self) -> list[int]:
        """The per-token mask every loss term and its normaliser use: `loss_mask` when the sample trains, all zeros
        when it does not (a sample failed after earlier partial segments keeps their tokens, and none may train)."""
        return self.loss_mask if self.trainable else [0] * len(self.response_ids)

    def check(self) -> None:
        n = len(self.response_ids)
        lengths = (len(self.rollout_logprobs), len(self.weight_versions), len(self.loss_mask))
        if any(length != n for length in lengths):
            raise ValueError(f"sample {self.group_id}/{self.index}: per-token lists differ in length: "
                             f"ids={n} logprobs/versions/mask={lengths}")

    def restart(self) -> None:
        """Drop the response: the sample is generated again from its prompt."""
        self.response, self.response_ids, self.rollout_logprobs = "", [], []
        self.weight_versions, self.loss_mask, self.reward = [], [], 0.0
        self.status, self.error, self.excluded, self.meta = Status.PENDING, "", "", {}

    def to_dict(self) -> dict:
        """JSON-serialisable form (checkpoints of the partial-rollout buffer); `from_dict` inverts it."""
        return {**dataclasses.asdict(self), "status": self.status.value}

    @classmethod
    def from_dict(cls, data: dict) -> Sample:
        return cls(**{**data, "status": Status(data["status"])})
