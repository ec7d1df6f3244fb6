"""Bucket planner: group HF-named tensors, in their given order, into buckets of at most `bucket_bytes`.

A tensor larger than the bucket size travels alone in its own bucket. Order is preserved, so both ends of a
broadcast agree on it without negotiation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.nbytes += tensor.numel() * tensor.element_size()


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Yield buckets lazily, so only one bucket of gathered tensors is alive at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket = Bucket()
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket.names and bucket.nbytes + size > bucket_bytes:
            yield bucket
            bucket = Bucket()
        bucket.add(name, tensor)
    if bucket.names:
        yield bucket
