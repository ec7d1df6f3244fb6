"""One RL step's data on a trainer rank: `RolloutBatch`.

Built by `rl_step.prepare` from the step's samples and used by `rl_step.advantages` and `rl_step.train` within the
same `TrainerWorker.rl_step` call: this rank's share of the samples, split into minibatches of micro-batches, and per
micro-batch the per-token inputs of the losses as the step produces them (old and reference logprobs, critic values,
then advantages and returns). Everything here lives in host memory (pinned on a GPU); `run_schedule` moves one
micro-batch at a time to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimish.sample import Sample
from slimish.trainer.batch import MicroBatch


@dataclass
class RolloutBatch:
    samples: list[Sample]                  # the whole step's samples, as every rank receives them
    indices: list[int]                     # the step indices of this rank's samples, in the order of `microbatches`
    chunks: list[list[list[Sample]]]       # per minibatch, per micro-batch: its samples
    microbatches: list[list[MicroBatch]]   # the same, collated

    def local_responses(self, field: str) -> list[torch.Tensor] | None:
        """Each of this rank's samples' [response length] values of the per-token micro-batch `field` (e.g.
        "loss_mask", "old_logprobs"), in the order of `indices`. Empty off the last pipeline stage (no logprobs are
        made there); None when the step has no such values (no reference model, no critic)."""
        return self.local_fields(field)[field]

    def local_fields(self, *fields: str) -> dict[str, list[torch.Tensor] | None]:
        """`local_responses` of each of `fields` (field -> its values), gathered in one pass over the
        micro-batches."""
        if not self.on_last_stage:
            return {field: [] for field in fields}
        mbs = [mb for minibatch in self.microbatches for mb in minibatch]
        out: dict[str, list[torch.Tensor] | None] = {
            field: None if any(getattr(mb, field) is None for mb in mbs) else [] for field in fields}
        for mb in mbs:
            for field, values in out.items():
                if values is not None:
                    values += mb.gather(getattr(mb, field))
        return out

    def scatter(self, field: str, per_sample: list[torch.Tensor]) -> None:
        """Set the per-token micro-batch `field` from one [response length] tensor per local sample, in the order of
        `indices` (the inverse of `local_responses`); on the last pipeline stage only."""
        values = iter(per_sample)
        for minibatch in self.microbatches:
            for mb in minibatch:
                setattr(mb, field, mb.scatter([next(values) for _ in mb.spans]))

    @property
    def on_last_stage(self) -> bool:
        """Whether this rank made logprobs for its micro-batches (the last pipeline stage does, after
        rl_step.prepare)."""
        return all(mb.old_logprobs is not None for minibatch in self.microbatches for mb in minibatch)

    @property
    def minibatch_samples(self) -> int:
        return len(self.samples) // len(self.microbatches)
