"""What happens to responses cut at `rollout.max_new_tokens` (`rollout.overlong`), applied to a group once its
rewards are set:

- `train`: nothing; truncated responses train like complete ones.
- `filter`: truncated responses are kept out of the loss (`Sample.excluded = "overlong"`); their rewards still count
  in their group's baseline, since the group was sampled with them (DAPO's overlong filtering masks the loss only).
- `penalty`: DAPO's soft overlong punishment, added to every scored response's reward by its length: 0 up to
  max_new_tokens - buffer_tokens, then falling linearly to -penalty_factor at max_new_tokens (where every truncated
  response ends). A response whose reward failed keeps `reward.failure_reward` unchanged.
"""

from __future__ import annotations

import numpy as np

from slimish.config.schema import OverlongConfig
from slimish.sample import Sample, Status

FILTERED = "overlong"


def length_penalty(length: int, *, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO's soft length penalty in [-1, 0] for a response of `length` tokens."""
    start = max_tokens - buffer_tokens
    if length <= start:
        return 0.0
    return max(-1.0, (start - length) / buffer_tokens)


def apply(samples: list[Sample], cfg: OverlongConfig, *, max_tokens: int) -> None:
    """Apply `cfg` to scored `samples` (in place). The penalty is recorded in `meta["length_penalty"]`."""
    for sample in samples:
        if not sample.scored:
            continue
        if cfg.mode == "filter" and sample.status is Status.TRUNCATED:
            sample.excluded = FILTERED
        elif cfg.mode == "penalty" and not sample.error:
            penalty = cfg.penalty_factor * length_penalty(len(sample.response_ids), max_tokens=max_tokens,
                                                          buffer_tokens=cfg.buffer_tokens)
            sample.reward += penalty
            sample.meta["length_penalty"] = penalty


def metrics(samples: list[Sample]) -> dict:
    """Response lengths of the scored samples (p50, p95, max), the fraction of them cut at max_new_tokens, and what
    `rollout.overlong` did: responses kept out of the loss, responses whose reward got a length penalty."""
    scored = [s for s in samples if s.scored]
    lengths = [len(s.response_ids) for s in scored]
    p50, p95 = np.percentile(lengths, [50, 95]).tolist() if lengths else (0.0, 0.0)
    return {
        "response_len_p50": p50, "response_len_p95": p95, "response_len_max": max(lengths, default=0),
        "truncated_frac": sum(1 for s in scored if s.status is Status.TRUNCATED) / max(len(scored), 1),
        "overlong_filtered": sum(1 for s in scored if s.excluded == FILTERED),
        "overlong_penalized": sum(1 for s in scored if s.meta.get("length_penalty", 0.0) != 0.0),
    }
