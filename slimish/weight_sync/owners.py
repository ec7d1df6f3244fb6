"""Several senders of the sharded sync: every later pipeline stage's leader sends its own stage, and with trainer
expert parallelism each expert goes from the trainer rank that owns it (any transport; rank 0 picks the route at
connect, `WeightSender._senders_route`).

Without them every expert travels from its expert-parallel (EP) rank to EP rank 0, every later stage's tensors to
rank 0, and on, from rank 0, to the engines. With them, each sender (a stage's leader, or ETP rank 0 of an EP rank of
the source replica: `export_owned_hf_tensors`, or on the "stages" route a stage's leader with its whole stage,
`export_stage_hf_tensors`) cuts its tensors into the engine ranks' parts (`EngineShards`, experts into their slots),
stages them itself and hashes them (`ExpectedChecksums.add_shard`); only what names the staged bytes travels to
rank 0, over a gloo group of every rank (`WeightSender._control_group`):
- `tensor`: per engine and engine rank, a pickle of handles to the sender's own shared segments (`stage_shards`);
- `disk`: the paths of the sender's own per-rank safetensors files;
- `broadcast`: per engine and engine rank r, the `receive_shard` entry naming the sender's own group r (the sender
  at rank 0, rank r of every engine after it: `OwnerGroups`), which the sender broadcasts rank r's part over once
  rank 0 has posted the request; none of its bytes pass rank 0.
Rank 0 posts every request to the engines, for its own buckets and for the other senders' (an SGLang engine serves
weight-update requests one at a time, in arrival order: one poster keeps every engine in the same order, see
`slimish.weight_sync.stages`), in rounds: its own next bucket and the next of every sender it may wait for
(`OwnerLink.ready`); over `broadcast` one request per round, each engine rank receiving from every sender of the
round at once (`BroadcastTransport.push_round`). Which senders it may wait for: a stage's export gathers the
parameters outside the experts first, over TP groups its owners may share with the stage's leader (rank 0 for the
first stage), and a sender waiting for rank 0's answer must not hold up one of those gathers that another sender,
which rank 0 waits for, is in. So an owner is waited for once its stage's leader has passed those gathers
(`OwnedExport.dense_over`: rank 0's own export for the first stage, a later leader's in its messages), a later
stage's leader from the start.

Messages over the control group, between rank 0 and a sender (the stage senders' exchange, `StageLink`):
  owner -> rank 0   {"shards": what names the bucket, "nbytes": n, "rank_bytes": [per engine rank],
                     "dense_over": its export has passed its stage's parameters outside the experts}
  rank 0 -> owner   True | False     the engines have loaded it (its segments may be reused) | give up
                                     (broadcast: the engines have been asked for it, broadcast it now | give up;
                                     then once more: the engines have loaded it | give up, and close the groups,
                                     which ends the engines' receives, before rank 0 lets the engines go)
  owner -> rank 0   {"done": per-rank checksums or None, "phases": {...}, "nbytes": bytes staged}
  owner -> rank 0   {"failed": "why"}

Checksums: an owner predicts the engine parameters whose slots it sends (`ExpectedChecksums.add_shard`). Where an
engine rank holds slices of every expert (a TP engine without EP: every large MoE recipe's engines) one engine
parameter gets slots from several owners. CUDA engines hash with SGLang's tile hash, which adds up from parts hashed
apart (`slimish.weight_sync.tile_hash`): each owner's "done" message then carries, for such a parameter, its
partial (a `TileHash` of its slots at their offsets), and rank 0 combines them with its own (`checksums.merged`).
Which hash the engines report is read from their /server_info's device (`checksums.hash_kind`; EngineSharding
keeps it). CPU engines hash with SHA-256, which cannot be combined: with checksums on, the route is then taken only
where every engine expert block lies within one owner's experts (the engines' expert-parallel size a multiple of
the trainer's), elsewhere the experts go through rank 0 as before (still one slot at a time); without checksums
(weight_sync.verify off), anywhere. `owners_fit` decides.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from slimish import collectives, run_layout
from slimish.network import free_port
from slimish.weight_sync.buckets import FlatBuffers, ShardedBucket, plan_sharded_buckets
from slimish.weight_sync.checksums import TILE, ExpectedChecksums, hash_kind
from slimish.weight_sync.sharding import EngineLayout, EngineShards
from slimish.weight_sync.stages import StageLink, recv_message, send_message
from slimish.weight_sync.transport import WAIT_SLICE_S, PhaseTimes, TransportContext, hashing_shards

TRANSPORTS = ("tensor", "disk", "broadcast")


def owners_fit(layout: EngineLayout | None, trainer_ep: int, *, predicted: bool = True) -> bool:
    """Whether the owners' route can send this sync: expert slots on the sharded route, and, when the sync's
    checksums are `predicted`, either the engines' hash combines from parts hashed apart (the tile hash of CUDA
    engines, `checksums.hash_kind` of the engines' /server_info device) or every engine expert block lies within
    one trainer EP rank's experts (see the module docstring; without checksums, weight_sync.verify off, one engine
    parameter's slots may come from several owners)."""
    if layout is None or not layout.expert_slots or trainer_ep == 1 or layout.num_experts % trainer_ep:
        return False
    return not predicted or hash_kind(layout.sharding) == TILE or layout.sharding.ep % trainer_ep == 0


class OwnerLink(StageLink):
    """Rank 0's side of one sender: a later stage's leader (`leader`, none: takes turns with rank 0 from the start)
    or an owner of experts, taken once what its gathers share is over: an owner of the first stage once rank 0's own
    export has passed the parameters outside the experts (`after_own`), one of a later stage once its stage's leader
    has (`leader.dense_over`)."""
    sends_shards = True

    def __init__(self, *, stage: int, rank: int, group, group_name: str = "", after_own: bool = False,
                 leader: OwnerLink | None = None):
        self.after_own, self.leader = after_own, leader
        super().__init__(stage=stage, rank=rank, group=group, group_name=group_name)

    @property
    def label(self) -> str:
        return f"owner{self.rank}"

    def start(self) -> None:
        super().start()
        self.wiring = False  # broadcast: the owner was told to send the bucket and awaits the engines' verdict
        self.dense_over = False  # its export has passed its stage's parameters outside the experts

    def ready(self, own_past_dense: bool) -> bool:
        return super().ready(own_past_dense) and (self.leader is None or self.leader.dense_over)

    def next(self) -> dict:
        message = super().next()
        self.dense_over = self.dense_over or self.finished or message.get("dense_over", False)
        return message

    def wire(self) -> None:
        """Broadcast: the engines have been asked for the owner's bucket; it sends it now and awaits the verdict."""
        send_message(True, to=self.rank, group=self.group)
        self.wiring = True  # the reply owed is now the verdict

    def reply(self, go: bool) -> None:
        super().reply(go)
        self.wiring = False

    def interrupt(self) -> None:
        if self.wiring:  # it closes its groups, which ends the engines' receives, and sends nothing more
            self.reply(False)
            self.finished = True


class OwnerSender:
    """An owner's side (global rank `rank`, not rank 0): stages its experts' buckets with transport `transport`
    ("tensor", "disk" or "broadcast") for `engines` engines sharded as `layout`, and hands them to rank 0
    (`coordinator`) over `group`, one at a time. `disk_dir`: where the disk transport writes (rank 0 removes the
    files once loaded). `context` (broadcast): the connection's (rank 0's group name, the backend, the bucket
    deadline) with this owner's own address, where the engines meet its groups."""

    def __init__(self, *, rank: int, transport: str, layout: EngineLayout, engines: int, bucket_bytes: int,
                 coordinator: int, group, disk_dir: str = "",
                 expected_checksums: Callable[[], ExpectedChecksums] | None = None,
                 context: TransportContext | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"the owners' route sends over {TRANSPORTS}, not {transport}")
        self.rank, self.transport, self.layout, self.engines = rank, transport, layout, engines
        self.bucket_bytes, self.coordinator, self.group = bucket_bytes, coordinator, group
        self.disk_dir, self.expected_checksums = disk_dir, expected_checksums
        self.rank_buffers: list[FlatBuffers] | None = None  # tensor: the owner's own segments, reused (CPU)
        self.groups = OwnerGroups(context, rank=rank, engines=engines, bucket_bytes=bucket_bytes) \
            if transport == "broadcast" else None
        self._phases = PhaseTimes()
        self.sending = False

    def release(self, reason: str) -> None:
        """From any thread, while `send` runs: give up the join of the owner's groups (broadcast), the one wait not on
        rank 0 (which answers False once released); the send then reports the failure to rank 0."""
        if self.sending and self.groups is not None:
            self.groups.release(reason)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send this owner's experts (`named_tensors`, its `export_owned_hf_tensors`, consumed lazily, may be left
        part-consumed), bucket by bucket as rank 0 allows. A failure is reported to rank 0, not raised."""
        reply_owed, staged_bytes = False, 0
        if self.groups is not None:
            self.groups.released.clear()  # a release between syncs is ignored, as `release` says
        self.sending = True
        self._phases.pop()  # a failed send's phases are not this one's
        try:
            expected = self.expected_checksums() if self.expected_checksums else None
            shards = EngineShards(self.layout).stream(named_tensors)
            if expected is not None:
                shards = hashing_shards(shards, expected, self._phases)
            staged = self._staged(plan_sharded_buckets(shards, self.layout.sharding.tp, self.bucket_bytes))
            current = next(staged, None)
            while current is not None:
                bucket, message, _keep = current  # _keep: the staged segments, alive until the engines answer
                send_message({"shards": message, "nbytes": bucket.nbytes, "rank_bytes": bucket.rank_bytes,
                              "dense_over": getattr(named_tensors, "dense_over", True)},
                             to=self.coordinator, group=self.group)
                reply_owed, staged_bytes = True, staged_bytes + bucket.nbytes
                upcoming = next(staged, None)  # staged while the engines load this one (the other buffer)
                go, reply_owed = recv_message(source=self.coordinator, group=self.group), False
                if go and self.groups is not None:  # the engines wait in `receive_shard`: broadcast, await the verdict
                    reply_owed = True
                    with self._phases.phase("wire"):
                        self.groups.send(_keep)
                        go, reply_owed = recv_message(source=self.coordinator, group=self.group), False
                        if go:
                            self.groups.finish()
                if not go:
                    if self.groups is not None:
                        self.groups.abort()  # ends the engines' receives from this owner
                    return  # rank 0 failed: it releases the engines
                current = upcoming
            checksums = expected.result() if expected is not None else None
            send_message({"done": checksums, "phases": self._phases.pop(), "nbytes": staged_bytes},
                         to=self.coordinator, group=self.group)
        except Exception as exc:
            if self.groups is not None:
                self.groups.abort()
            if reply_owed and not recv_message(source=self.coordinator, group=self.group):
                return  # rank 0 gave up: it expects nothing more
            send_message({"failed": f"expert owner rank {self.rank}: {type(exc).__name__}: {exc}"},
                         to=self.coordinator, group=self.group)
        finally:
            self.sending = False

    def _staged(self, buckets: Iterable[ShardedBucket]):
        """(bucket, what names its staged bytes for rank 0, what must stay alive until the engines answer) for
        each bucket."""
        for bucket in buckets:
            if self.transport == "tensor":
                from slimish.weight_sync.tensor import stage_shards

                with self._phases.phase("flatten"):
                    if self.rank_buffers is None:
                        self.rank_buffers = rank_buffers(bucket)
                    placed, payloads = stage_shards(bucket, self.rank_buffers, self.engines)
                yield bucket, payloads, placed
            elif self.transport == "broadcast":
                with self._phases.phase("flatten"):
                    if self.rank_buffers is None:
                        self.rank_buffers = [FlatBuffers() for _ in bucket.ranks]
                    placed = [buffers.place(part) for buffers, part in zip(self.rank_buffers, bucket.ranks)]
                yield bucket, self.groups.payloads(bucket, placed), placed
            else:
                with self._phases.phase("write"):
                    written = self._write(bucket)
                yield bucket, written, None

    def _write(self, bucket: ShardedBucket) -> dict:
        """Each engine rank's part of `bucket` as a safetensors file of this owner's, in a directory of its own:
        {"dir": it, "files": per engine rank [(path, bytes)]}."""
        from slimish.weight_sync.disk import owning_tensors

        directory = Path(tempfile.mkdtemp(prefix=run_layout.SYNC_PREFIX, dir=self.disk_dir))
        files: list[list[tuple[str, int]]] = []
        for rank, part in enumerate(bucket.ranks):
            files.append([])
            if part.names:
                path = directory / f"owner{self.rank:05d}-rank{rank:03d}.safetensors"
                save_file(owning_tensors(part), str(path))
                files[rank].append((str(path), path.stat().st_size))
        return {"dir": str(directory), "files": files}

    def close(self) -> None:
        self.rank_buffers = None
        if self.groups is not None:
            self.groups.abort()


class OwnerGroups:
    """An owner's own groups with the engines (broadcast): group r with rank r of every engine, named after the
    connection (`context.group_name`) and the owner's rank, the owner at rank 0 at `context.master_addr`, joined at
    its first bucket (the engines join in `receive_shard`, in the order rank 0 posts the requests). The rendezvous
    and every broadcast are bounded by a bucket's deadline (`bucket_timeout_s` plus `bucket_bytes` at
    `min_bandwidth_mib_s`): an engine that never joins (it died before the request reached it) fails the join within
    it, not after the default group timeout."""

    def __init__(self, context: TransportContext, *, rank: int, engines: int, bucket_bytes: int):
        from datetime import timedelta

        self.context, self.engines = context, engines
        self.name = f"{context.group_name}_owner{rank}_rank{{rank}}"
        self.timeout = timedelta(
            seconds=context.bucket_timeout_s + bucket_bytes / (context.min_bandwidth_mib_s * 2**20))
        self.ports: list[int] | None = None
        self.groups: list | None = None
        self.pending: list = []  # the broadcasts of the bucket being sent
        self.released, self._reason = threading.Event(), ""

    def release(self, reason: str) -> None:
        """From any thread: end the join `send` is in (or its next one) at once, with an error saying `reason`."""
        self._reason = reason
        self.released.set()

    def _wait(self, done: Callable[[float], bool]) -> None:
        """`join_rank_groups`' wait: until `done`, or a `release`, which raises (the rendezvous ends by itself within
        `timeout`)."""
        while not done(WAIT_SLICE_S):
            if self.released.is_set():
                raise RuntimeError(f"released while joining its groups with the engines: {self._reason}")

    def payloads(self, bucket: ShardedBucket, placed: list) -> list[list[str]]:
        """Per engine, per engine rank, the `receive_shard` entry (JSON) of rank r's part of `bucket` (`placed[r]`):
        rank 0 puts it in a round's request beside the other senders' (`BroadcastTransport.push_round`)."""
        from slimish.weight_sync.broadcast import shard_specs

        ctx = self.context
        if self.ports is None:
            self.ports = [free_port() for _ in bucket.ranks]
        return shard_specs(bucket, placed, group=self.name, connection=ctx.group_name, address=ctx.master_addr,
                           ports=self.ports, engines=self.engines, backend=ctx.backend,
                           timeout_s=self.timeout.total_seconds())

    def send(self, placed: list) -> None:
        """Start broadcasting each rank's part (`placed[r]`) over group r (joined first, at the first bucket)."""
        from slimish.weight_sync.broadcast import join_rank_groups

        if self.groups is None:
            ctx = self.context
            self.groups = join_rank_groups(backend=ctx.backend, address=ctx.master_addr, ports=self.ports,
                                           engines=self.engines, group=self.name, timeout=self.timeout,
                                           wait=self._wait)
        self.pending = [collectives.broadcast(flat, src=0, group=group, async_op=True)
                        for (flat, _), group in zip(placed, self.groups)]

    def finish(self) -> None:
        """The engines have loaded the bucket: its broadcasts are over (each waited for, within the group's timeout)."""
        for work in self.pending:
            work.wait()
        self.pending = []

    def abort(self) -> None:
        """Destroy the groups (a broadcast still pending fails on the engines' side; on gloo the destroy returns at
        once; on NCCL the communicators are aborted, and each engine rank aborts its own at its deadline,
        `engine_loader.receive_shard`); a later connection makes new ones under new names."""
        from slimish.weight_sync.process_group import abort_group
        from slimish.weight_sync.transport import keep_until_done

        pending = self.pending or [None] * len(self.groups or [])
        for group, work in zip(self.groups or [], pending):
            abort_group(group, self.context.backend)
            if work is not None and not work.is_completed():  # the group must outlive the send it could not finish
                keep_until_done(work, group)
        # Not used again: the next sync is on a new connection (new names, new ports).
        self.groups, self.pending, self.ports = None, [], None


def rank_buffers(bucket: ShardedBucket) -> list[FlatBuffers]:
    """The tensor transport's per-engine-rank buffers for buckets like `bucket` (shared by name, reused on the CPU;
    fresh per bucket on a GPU, see `slimish.weight_sync.tensor`)."""
    from slimish.weight_sync.tensor import share_by_name

    device = next((b.tensors[0].device for b in bucket.ranks if b.tensors), torch.device("cpu"))
    return [FlatBuffers(share=share_by_name, reuse=device.type == "cpu") for _ in bucket.ranks]


def remove_dirs(dirs: Iterable[str]) -> None:
    for directory in dirs:
        shutil.rmtree(directory, ignore_errors=True)
