"""Samples as a test writes them: only what the test is about, the rest defaulted.

`sample(...)` is a `Sample` that finished generating: its `status` COMPLETED unless given, its per-token lists as
long as its response. `rollout_logprobs`, `weight_versions` and `loss_mask` each take a list (one value per response
token) or one value for every token (defaults: logprob 0.0, version 0, trained 1). Any other field of `Sample`
(`label`, `response`, `reward`, `error`, `meta`, `columns`, ...) passes through. `group(responses, ...)` is group 0
of such samples, sample i answering the text `responses[i]` with one token.
"""

from __future__ import annotations

from collections.abc import Sequence

from slimish.sample import Sample, Status


def _per_token(value, n: int) -> list:
    return list(value) if isinstance(value, Sequence) else [value] * n


def sample(*, response_ids: Sequence[int] = (1,), prompt_ids: Sequence[int] = (1,), group_id: int = 0,
           index: int = 0, prompt: str = "p", rollout_logprobs: float | Sequence[float] = 0.0,
           weight_versions: int | Sequence[int] = 0, loss_mask: int | Sequence[int] = 1,
           status: Status = Status.COMPLETED, **fields) -> Sample:
    """A generated sample (see the module's docstring); the lists given are copied."""
    n = len(response_ids)
    return Sample(group_id=group_id, index=index, prompt=prompt, prompt_ids=list(prompt_ids),
                  response_ids=list(response_ids), rollout_logprobs=_per_token(rollout_logprobs, n),
                  weight_versions=_per_token(weight_versions, n), loss_mask=_per_token(loss_mask, n), status=status,
                  **fields)


def group(responses: Sequence[str], **fields) -> list[Sample]:
    """Group 0: sample i (index i) completed with the response text `responses[i]` (one token), and `fields`."""
    return [sample(index=i, response=text, **fields) for i, text in enumerate(responses)]
