"""Bucket planner: group HF-named tensors, in their given order, into buckets of at most `bucket_bytes`.

A tensor larger than the bucket size travels alone in its own bucket. Order is preserved, so both ends of a
broadcast agree on it without negotiation. The sharded sync's buckets (`ShardedBucket`, `plan_sharded_buckets`)
hold one bucket per engine rank of engine parameters, each rank's at most `bucket_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
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


@dataclass
class ShardedBucket:
    """One bucket of the sharded sync: `ranks[r]` holds engine rank r's engine parameters (SGLang names and
    layout), possibly none."""
    ranks: list[Bucket]

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.ranks)

    @property
    def rank_bytes(self) -> list[int]:
        return [bucket.nbytes for bucket in self.ranks]


def plan_sharded_buckets(shards: Iterable[tuple[int, str, torch.Tensor]], tp: int,
                         bucket_bytes: int) -> Iterator[ShardedBucket]:
    """Group (engine rank, engine parameter, tensor) items, in their order, into buckets in which no rank holds more
    than `bucket_bytes` (a larger parameter travels alone on its rank); lazily, like `plan_buckets`."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket = ShardedBucket([Bucket() for _ in range(tp)])
    for rank, name, tensor in shards:
        own = bucket.ranks[rank]
        if own.names and own.nbytes + tensor.numel() * tensor.element_size() > bucket_bytes:
            yield bucket
            bucket = ShardedBucket([Bucket() for _ in range(tp)])
            own = bucket.ranks[rank]
        own.add(name, tensor)
    if bucket.nbytes or any(b.names for b in bucket.ranks):
        yield bucket


class FlatBuffers:
    """Flattens buckets (each tensor's bytes, in order, as one uint8 tensor: SGLang's "flattened_bucket" layout) into
    two buffers used in turn. A sender has at most two buckets alive (one being filled while the engines still read
    the other), so bucket k+2 may overwrite bucket k's buffer. Reusing them instead of allocating a buffer per bucket
    saves the allocation's page faults: flattening 1 GiB into 64 MiB buckets on CPU took 0.79 s into fresh buffers
    and 0.12-0.15 s into reused ones (`bench/flatten.py`).
    A buffer grows when a bucket does not fit (a tensor larger than the bucket size travels alone); `share(buffer)`
    is applied to every new buffer (the tensor transport puts it in shared memory). The buffers live as long as this
    object (two buckets' worth of memory on the sending device). `reuse=False`: every bucket gets a new buffer (the
    caller holds it as long as it must live)."""

    def __init__(self, share: Callable[[torch.Tensor], None] | None = None, *, reuse: bool = True):
        self._share = share
        self._reuse = reuse
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def flatten(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's bytes in the next buffer (a view of exactly `bucket.nbytes`)."""
        flat = self._next(bucket.nbytes, bucket.tensors[0].device)
        torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in bucket.tensors], out=flat)
        return flat

    def place(self, bucket: Bucket, align: int = 64) -> tuple[torch.Tensor, list[int]]:
        """The bucket's tensors copied into the next buffer, each starting at a multiple of `align` bytes (so that
        each can be viewed as its dtype): (the buffer's used part, each tensor's byte offset in it). Views of one
        buffer (`views`) pickle as handles to one storage: one shared segment per bucket however many tensors."""
        offsets, end = [], 0
        for tensor in bucket.tensors:
            offsets.append(end)
            end = -(-(end + tensor.numel() * tensor.element_size()) // align) * align
        flat = self._next(max(end, align), bucket.tensors[0].device if bucket.tensors else torch.device("cpu"))
        for view, tensor in zip(views(flat, bucket, offsets), bucket.tensors):
            view.copy_(tensor.detach())
        return flat, offsets

    def _next(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The next buffer's first `nbytes` (grown, or new when not reused)."""
        buffer = self._buffers[self._turn]
        if not self._reuse or buffer is None or buffer.numel() < nbytes or buffer.device != device:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if self._share is not None:
                self._share(buffer)
            self._buffers[self._turn] = buffer if self._reuse else None
        self._turn ^= 1
        return buffer[:nbytes]


def views(flat: torch.Tensor, bucket: Bucket, offsets: list[int]) -> list[torch.Tensor]:
    """Each of `bucket`'s tensors as a view of `flat` (uint8) at its byte offset, of its dtype and shape."""
    return [flat[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, start in zip(bucket.tensors, offsets)]
