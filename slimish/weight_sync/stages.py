"""Stage-parallel senders (`broadcast` transport, trainer pipeline-parallel > 1): the leader (tp = ep = 0) of every
pipeline stage sends its own layers to the engines over a process group of its own; rank 0, stage 0's leader,
posts every request to the engines, for its own buckets and for the other stages'.

Why rank 0 posts them all: an SGLang engine serves weight-update requests one at a time, in the order they reach it
(0.5.23: the tokenizer manager's `model_update_lock`). If each stage posted its own, engine A could take stage 0's
bucket first and engine B stage 1's, and each broadcast would wait forever for the engine inside the other. So the
stages take turns on the wire, one bucket each in stage order, and every engine sees the same order; they export,
gather, flatten and hash concurrently, and no byte of a later stage passes through rank 0 (before, every later
stage sent its layers to rank 0, which sent them on).

Messages over the pipeline group, between rank 0 and a later stage's leader:
  leader -> rank 0   {"bucket": names/dtypes/shapes, "nbytes": n}   a flattened bucket is ready
  rank 0 -> leader   True | False                     the engines have been asked for it: broadcast it | give up
  leader -> rank 0   {"done": checksums or None, "phases": {...}}   the stage is sent
  leader -> rank 0   {"failed": "why"}                its broadcast failed (an engine died); its group is closed
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from slimish.engines.client import EngineClient
from slimish.weight_sync.broadcast import BroadcastTransport
from slimish.weight_sync.buckets import plan_buckets
from slimish.weight_sync.checksums import ExpectedChecksums
from slimish.weight_sync.transport import TransportContext, tensor_meta


def send_message(message, *, to: int, group) -> None:
    """Send one picklable message to global rank `to` over `group` (the stage and owner exchanges)."""
    dist.send_object_list([message], dst=to, group=group)


def recv_message(*, source: int, group):
    """The next message from global rank `source` over `group` (blocks until it comes)."""
    box = [None]
    dist.recv_object_list(box, src=source, group=group)
    return box[0]


class StageLink:
    """Rank 0's side of one later stage: its leader's global rank, the pipeline group the messages travel on, and
    the name of the leader's weight-update group (which the engines' requests name)."""

    def __init__(self, *, stage: int, rank: int, group, group_name: str):
        self.stage, self.rank, self.group, self.group_name = stage, rank, group, group_name
        self.start()

    #: Rank 0 takes this link's buckets only once its own export has passed the parameters outside the experts
    #: (stage 0's expert owners', see `slimish.weight_sync.owners`); a stage's take turns with rank 0's.
    after_own = False
    #: Whether the sender sends each engine rank only its own part (`OwnerLink`); a stage's sends the whole stage.
    sends_shards = False

    def ready(self, own_past_dense: bool) -> bool:
        """Whether rank 0 may wait for this sender's next bucket now (`own_past_dense`: rank 0's own export has passed
        the parameters outside the experts, or ended): a sender whose next bucket may wait on a gather rank 0 or
        another sender still holds up must not be waited for (see `slimish.weight_sync.owners`)."""
        return own_past_dense or not self.after_own

    @property
    def label(self) -> str:
        """How the link's metrics are suffixed."""
        return f"stage{self.stage}"

    def start(self) -> None:
        """Before each sync: nothing exchanged yet."""
        self.reply_owed = self.finished = False

    def next(self) -> dict:
        """The leader's next message (blocks until it has one)."""
        message = recv_message(source=self.rank, group=self.group)
        bucket = "bucket" in message or "shards" in message
        self.reply_owed, self.finished = bucket, not bucket
        return message

    def reply(self, go: bool) -> None:
        send_message(go, to=self.rank, group=self.group)
        self.reply_owed = False

    def interrupt(self) -> None:
        """After rank 0 failed mid-sync, before it lets the engines go: a sender still sending on its own groups
        gives up now (`OwnerLink`); a stage's leader learns it in `release`."""

    def release(self) -> str | None:
        """After rank 0 failed mid-sync: tell the leader to give up (it then drains its export and sends nothing
        more), whatever point of the exchange it is at. Returns the leader's own failure if it reported one (then
        likely the cause of rank 0's: the engines fail a receive whose sender closed its group)."""
        if self.finished:
            return None
        failure = None
        if not self.reply_owed:
            failure = self.next().get("failed")
        if self.reply_owed:
            self.reply(False)
        self.finished = True
        return failure


class StageSender:
    """A later pipeline stage's leader: its own group with the engines, and its stage's buckets sent when rank 0
    says so. `coordinator`: rank 0's global rank; `group`: the pipeline group shared with it."""

    def __init__(self, *, stage: int, context: TransportContext, engine_urls: list[str], bucket_bytes: int,
                 coordinator: int, group, expected_checksums: Callable[[], ExpectedChecksums] | None = None,
                 new_client: Callable[..., EngineClient] = EngineClient):
        self.stage, self.bucket_bytes = stage, bucket_bytes
        self.coordinator, self.group = coordinator, group
        self.expected_checksums = expected_checksums
        self.clients = [new_client(url, api_key=context.api_key) for url in engine_urls]
        self.transport = BroadcastTransport(context)
        self.sending = False
        self.stalled_s = 0.0

    def release(self, reason: str) -> None:
        """As `WeightSync.release`: give up the broadcast this stage is in (it then reports the failure to rank 0)."""
        if self.sending:
            self.transport.release(reason)

    def connect(self) -> None:
        self.transport.connect(self.clients)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send this stage's tensors (`named_tensors`, consumed lazily, may be left part-consumed), bucket by bucket
        as rank 0 allows. A failure is reported to rank 0, not raised: rank 0 fails the sync."""
        reply_owed = False
        self.sending = True
        self.transport.start_sync()
        try:
            expected = self.expected_checksums() if self.expected_checksums else None
            tensors = named_tensors if expected is None else self.transport.hashing(named_tensors, expected)
            flattened = self._flattened(plan_buckets(tensors, self.bucket_bytes))
            current = next(flattened, None)
            while current is not None:
                bucket, flat = current
                send_message({"bucket": tensor_meta(bucket), "nbytes": flat.numel()}, to=self.coordinator,
                             group=self.group)
                reply_owed = True
                upcoming = next(flattened, None)  # the next bucket is made while this one waits for its turn
                go, reply_owed = recv_message(source=self.coordinator, group=self.group), False
                if not go:
                    return  # rank 0 failed: it releases the engines
                self.transport.wire(flat, deadline=self.transport.deadline(flat.numel()))
                current = upcoming
            checksums = expected.result() if expected is not None else None
            send_message({"done": checksums, "phases": self.transport.pop_phases()}, to=self.coordinator,
                         group=self.group)
        except Exception as exc:
            self.stalled_s = time.monotonic() - self.transport.progress_at
            if reply_owed:  # rank 0 answers the bucket this stage announced; if it asked the engines for it,
                recv_message(source=self.coordinator, group=self.group)  # closing the group below releases them
            # Engines blocked receiving one of this stage's buckets fail that receive once the group is gone.
            self.transport.abort()
            self.transport.pop_phases()
            send_message({"failed": f"pipeline stage {self.stage}: {type(exc).__name__}: {exc}"},
                         to=self.coordinator, group=self.group)
        finally:
            self.sending = False

    def _flattened(self, buckets):
        for bucket in buckets:
            with self.transport.phase("flatten"):
                flat = self.transport.buffers.flatten(bucket)
            yield bucket, flat

    def close(self) -> None:
        self.transport.close()
        for client in self.clients:
            client.close()
