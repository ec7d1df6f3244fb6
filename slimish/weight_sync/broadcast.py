"""`broadcast` transport: a torch.distributed group between the sending trainer rank and every engine rank (gloo on
CPU, NCCL on GPU: only the backend string differs). Per bucket every engine is told the bucket's names, dtypes and
shapes over HTTP (`/update_weights_from_distributed`, SGLang's "flattened_bucket" layout) while the sender
broadcasts one flat uint8 tensor: the tensors' bytes concatenated in order.

Overlap: `push` returns once its bucket is on the wire, without waiting for the engines to load it; the next
bucket is exported and flattened meanwhile, and the next `push` waits for the engines' answers before it sends. So
at most two buckets are alive on the sender (the one being loaded has already left it), flattened into two reused
buffers (`FlatBuffers`), and the last bucket, which flips the version, is waited for before `push` returns.

Sharded (`weight_sync.sharded`; auto picks it on gloo, see `shards_under_auto`): engine rank r
of every engine and the sender form a group of their own (group r: the sender at rank 0, engine e at rank 1 + e),
joined by slimish's engine-side loader (`slimish.weight_sync.engine_loader.receive_shard`, registered by
--custom-weight-loader) at the first bucket. Per bucket every engine is asked (`/update_weights_from_tensor`, that
loader as load_format; rank r's payload describes its part) while the sender broadcasts rank r's part over group r,
every group at once: each engine rank receives only its own parameters. Overlapped and given up like the full path
(a given-up bucket destroys the sender's side of every group, NCCL's aborted; a release ends even the groups' join);
a group's engine side ends by itself at the bucket's deadline, which each entry carries, if its receive has not
(`receive_shard`), and is dropped when that engine joins a later connection's (new names: a restarted engine joins
new groups at the next sync). With several senders (`slimish.weight_sync.owners`) a request is a round
(`push_round`): every sender's next bucket, each engine rank receiving its parts from all of them at once. The
job-level engine-crash test runs on it (tests/e2e/test_engine_crash.py, from two senders)."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from slimish import collectives
from slimish.config.engine_flags import SHARD_RECEIVER
from slimish.engines.client import EngineClient, EngineError
from slimish.network import free_port
from slimish.weight_sync.buckets import Bucket, FlatBuffers, ShardedBucket
from slimish.weight_sync.process_group import abort_group, destroy_group, new_weight_update_group
from slimish.weight_sync.transport import LET_GO_S, Owned, SyncReleased, Transport, keep_until_done, tensor_meta

logger = logging.getLogger(__name__)


class BroadcastTransport(Transport):
    shards = True
    shard_loader = SHARD_RECEIVER

    @classmethod
    def shards_under_auto(cls, backend: str) -> bool:
        # Both sides' waits are bounded and both end their groups by themselves (the sender aborts its communicators,
        # each engine rank its own at the bucket's deadline, `engine_loader.receive_shard`), but NCCL sets a
        # communicator up lazily, inside the first collective's host call, which blocks until every member has come:
        # an engine rank that never joins leaves the sender (and the other engine ranks) there, out of reach of any
        # release or deadline (docs/weight-sync.md, "Sharded sync"). 'auto' keeps NCCL on the full path until the
        # set-up is eager and non-blocking; 'on' runs it.
        return backend == "gloo"

    def connect(self, clients: list[EngineClient]) -> None:
        super().connect(clients)
        ctx = self.context
        self.group, self._joined = None, False
        self.buffers = FlatBuffers()
        self.rank_groups: list | None = None  # the sharded path's, one per engine rank, joined at the first bucket
        self.rank_buffers: list[FlatBuffers] | None = None
        self._given_up_groups: list = []
        if self.sharded:
            return
        world_size = 1 + len(clients) * ctx.engine_tp
        joins = [self._pool.submit(c.init_weights_update_group, master_address=ctx.master_addr,
                                   master_port=ctx.master_port, rank_offset=1 + i * ctx.engine_tp,
                                   world_size=world_size, group_name=ctx.group_name, backend=ctx.backend)
                 for i, c in enumerate(clients)]
        self.group = new_weight_update_group(backend=ctx.backend, master_address=ctx.master_addr,
                                             master_port=ctx.master_port, world_size=world_size, rank=0,
                                             group_name=ctx.group_name)
        for join in joins:
            join.result()
        self._joined = True

    def push(self, bucket: Bucket, *, version: str | None) -> int:
        with self.phase("flatten"):  # while the engines load the previous bucket
            flat = self.buffers.flatten(bucket)
        self.wait_loaded()
        meta = dict(**tensor_meta(bucket), group_name=self.context.group_name, weight_version=version,
                    flush_cache=version is not None)
        deadline = self.deadline(flat.numel())
        self.loading(self.on_all(lambda c: c.update_weights_from_distributed(**meta)), deadline=deadline)
        self.wire(flat, deadline=deadline)
        if version is not None:
            self.wait_loaded()
        return flat.numel()

    def wire(self, flat, *, deadline: float) -> None:
        """Broadcast `flat` to the engines (phase 'wire'), issued asynchronously and waited for until `deadline` or a
        `release`: a gloo send to an engine frozen, or killed while the send was blocked on it, never completes
        (reproduced with three processes; in a job the sender sat out the group's 10-minute timeout), and waiting
        on the Work with a bound is what lets the sender go."""
        with self.phase("wire"):
            work = collectives.broadcast(flat, src=0, group=self.group, async_op=True)
            self.wait_work(work, deadline=deadline, what="the broadcast of a bucket")

    def push_shards(self, bucket: ShardedBucket, *, version: str | None) -> int:
        placed = self._place(bucket)
        self.wait_loaded()
        deadline = self.deadline(max(flat.numel() for flat, _ in placed))
        payloads = self._payloads([self._own_specs(bucket, placed, deadline)], len(bucket.ranks))
        self.loading(self.on_all(lambda c: c.update_weights_from_tensor(
            serialized=payloads[c.url], load_format=SHARD_RECEIVER, weight_version=version,
            flush_cache=version is not None)), deadline=deadline)
        self._join_own(len(bucket.ranks), deadline)
        self._wire_own(placed, deadline)
        if version is not None:
            self.wait_loaded()
        return bucket.nbytes

    def push_round(self, own: ShardedBucket | None, owned: list[Owned]) -> int:
        """Rank 0's bucket `own` and every other sender's next bucket (`owned`, each `shards[e][r]` engine e's rank
        r's `receive_shard` entry naming the sender's own group r, `shard_specs`) in one request per engine: each
        engine rank joins the round's groups in entry order (rank 0's first) and receives its part from every sender
        at once, so the round takes the busiest link's time, not the sum of the senders'. Then `wire()` tells each
        sender to broadcast, rank 0 broadcasts its own parts, and once every engine has loaded the round `go()` lets
        each sender go on. A failed wait raises (the sync then tells the senders to give up: `OwnerLink`)."""
        if not owned:
            return self.push_shards(own, version=None) if own is not None else 0
        placed = self._place(own) if own is not None else None
        self.wait_loaded()
        # Each engine rank receives all of its parts at once: the round is due as their sum would be alone.
        deadline = self.deadline(sum(max(bucket.rank_bytes) for bucket in owned)
                                 + (max(own.rank_bytes) if own is not None else 0))
        timeout_s = deadline - time.monotonic()
        entries = [self._own_specs(own, placed, deadline)] if own is not None else []
        entries += [[[_with_timeout(spec, timeout_s) for spec in ranks] for ranks in bucket.shards]
                    for bucket in owned]
        ranks = len(own.ranks) if own is not None else len(owned[0].rank_bytes)
        payloads = self._payloads(entries, ranks)
        self.loading(self.on_all(lambda c: c.update_weights_from_tensor(
            serialized=payloads[c.url], load_format=SHARD_RECEIVER, weight_version=None, flush_cache=False)),
            deadline=deadline)
        if own is not None:  # the engine ranks join rank 0's groups first, then the others'
            self._join_own(ranks, deadline)
        for bucket in owned:
            if bucket.wire is not None:
                bucket.wire()
        if own is not None:
            self._wire_own(placed, deadline)
        self.wait_loaded()
        for bucket in owned:
            bucket.go()
        return own.nbytes if own is not None else 0

    def _payloads(self, entries: list[list[list[str]]], ranks: int) -> dict[str, list[str]]:
        """{engine url: its per-rank payloads} of a round whose senders' entries are `entries` (`round_payloads`)."""
        return dict(zip((c.url for c in self.clients), round_payloads(entries, len(self.clients), ranks)))

    def _place(self, bucket: ShardedBucket) -> list:
        """Each engine rank's part of `bucket` in its reused flat buffer (phase 'flatten')."""
        with self.phase("flatten"):
            if self.rank_buffers is None:
                self.rank_buffers = [FlatBuffers() for _ in bucket.ranks]
            return [buffers.place(part) for buffers, part in zip(self.rank_buffers, bucket.ranks)]

    def _own_specs(self, bucket: ShardedBucket, placed: list, deadline: float) -> list[list[str]]:
        """Per engine, per rank, the `receive_shard` entry of rank 0's part of `bucket` over rank 0's group r."""
        ctx = self.context
        if self.rank_groups is None:
            self._ports = [free_port() for _ in bucket.ranks]
        return shard_specs(bucket, placed, group=f"{ctx.group_name}_rank{{rank}}", connection=ctx.group_name,
                           address=ctx.master_addr, ports=self._ports, engines=len(self.clients),
                           backend=ctx.backend, timeout_s=deadline - time.monotonic())

    def _join_own(self, ranks: int, deadline: float) -> None:
        """Rank 0's groups with the engine ranks, joined at its first bucket (the engines are asked for it)."""
        if self.rank_groups is not None:
            return
        from datetime import timedelta

        left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
        try:
            self.rank_groups = self._join_rank_groups(ranks, timeout=left, deadline=deadline)
        except Exception:
            # An engine rank that failed the request never joined: its error is the cause. The others answer
            # once their groups are gone (within LET_GO_S).
            self._loading_deadline = time.monotonic() + LET_GO_S
            self.wait_loaded()
            raise

    def _wire_own(self, placed: list, deadline: float) -> None:
        """Broadcast each rank's part over its group, every group at once, waited for until `deadline`. A broadcast
        that fails because a peer went away (an engine rank died mid-bucket) raises the engines' own failure where
        one answers within LET_GO_S: it names the engine, where gloo's names only an address."""
        with self.phase("wire"):
            works = [collectives.broadcast(flat, src=0, group=group, async_op=True)
                     for (flat, _), group in zip(placed, self.rank_groups)]
            try:
                for work in works:
                    self.wait_work(work, deadline=deadline, what="the broadcast of a rank's part of a bucket")
            except SyncReleased:
                raise
            except Exception as exc:
                failed = wait_futures(self._loading, timeout=LET_GO_S, return_when=FIRST_EXCEPTION).done
                cause = next((call.exception() for call in self._loading if call in failed and call.exception()),
                             None)
                if cause is None:
                    raise
                raise cause from exc

    def _join_rank_groups(self, tp: int, timeout=None, deadline: float = float("inf")) -> list:
        """Group r with rank r of every engine (which joins it in its first `receive_shard`), all at once; the
        rendezvous bounded by `timeout` (an engine that failed the request never joins), waited for until `deadline`
        or a `release`, which end it at once (`SyncReleased`)."""
        ctx = self.context
        return join_rank_groups(backend=ctx.backend, address=ctx.master_addr, ports=self._ports,
                                engines=len(self.clients), group=f"{ctx.group_name}_rank{{rank}}", timeout=timeout,
                                wait=lambda done: self.wait_until(
                                    done, deadline=deadline, what="the engine ranks' joining of their groups"))

    def push_owned(self, shards: list[list[str]], *, rank_bytes: list[int], go: Callable[[], None],
                   wire: Callable[[], None] | None = None) -> None:
        """A round of one other sender's bucket alone (`push_round`)."""
        self.push_round(None, [Owned(shards, rank_bytes, go, wire)])

    def push_remote(self, meta: dict, *, nbytes: int, group_name: str, go: Callable[[], None]) -> None:
        """Ask every engine for a bucket that another rank broadcasts on its own group `group_name` (a pipeline
        stage's sender, `slimish.weight_sync.stages`), then `go()` tells that rank to send it. Ordered and
        overlapped like `push`: the engines' answers are awaited before the next bucket is asked for."""
        self.wait_loaded()
        request = dict(**meta, group_name=group_name, weight_version=None, flush_cache=False)
        self.loading(self.on_all(lambda c: c.update_weights_from_distributed(**request)),
                     deadline=self.deadline(nbytes))
        go()

    def abort(self) -> None:
        if self.sharded:  # as below, per rank group; on NCCL the engine ranks abort theirs at their deadline
            for group in self.rank_groups or []:
                abort_group(group, self.context.backend)
                if self.given_up is not None:
                    keep_until_done(self.given_up, group)
            self.rank_groups = None
            self.let_go()
            return
        # Closing the sender's side of the group makes an engine blocked receiving a bucket fail that receive (its
        # /update_weights_from_distributed answers success=false) instead of waiting out the group's timeout. On
        # gloo it returns at once even with a broadcast still pending (`wire` gave up on it); the group is not used
        # again: the next sync builds a new one with the engines that are left.
        if self.group is not None:
            if self.context.backend == "nccl" and self.given_up is not None:
                self._abort_nccl()
            else:
                destroy_group(self.group)
            if self.given_up is not None:  # the group must outlive the send it could not finish
                keep_until_done(self.given_up, self.group)
            self.group = None
        self.let_go()

    def _abort_nccl(self) -> None:
        """NCCL, a broadcast given up (UNVERIFIED: written for GPUs, not yet run on them; see docs/weight-sync.md).
        There the sender's host call returned long ago and the hang is a kernel on its stream, waiting for a peer;
        so is every survivor's (an NCCL broadcast is a ring: all ranks wait for the frozen one), behind the answer
        each already gave. The sender aborts its communicator (ncclCommAbort), which ends its kernel; each engine is
        asked to destroy its side of the group (SGLang's /destroy_weights_update_group), within `LET_GO_S`; those
        that do not answer are named in `hung`, and the job kills and restarts them like any hung engine."""
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group(self.group)
        calls = self.on_all(lambda c: c.destroy_weights_update_group(self.context.group_name))
        wait_futures(calls, timeout=LET_GO_S)
        self.hung = self.unanswered(calls)
        self._joined = False

    def close(self) -> None:
        if self._joined:
            for call in self.on_all(lambda c: c.destroy_weights_update_group(self.context.group_name)):
                try:
                    call.result()
                except EngineError as exc:
                    # An engine that is gone (it died, or the job is stopping its engines) keeps no group to destroy;
                    # anything else is worth a word.
                    if not exc.unreachable:
                        logger.warning("%s", exc)
            self._joined = False
        if self.group is not None:
            destroy_group(self.group)
            self.group = None
        for group in self.rank_groups or []:
            destroy_group(group)
        self.rank_groups = None
        super().close()


def shard_specs(bucket: ShardedBucket, placed: list, *, group: str, connection: str, address: str,
                ports: list[int], engines: int, backend: str, timeout_s: float) -> list[list[str]]:
    """Per engine, per engine rank r, the `receive_shard` entry (JSON) for rank r's part of `bucket` (`placed[r]`: its
    flat buffer and offsets) broadcast by a sender at `address` over its group r (`group.format(rank=r)`, rendezvous
    at `ports[r]`; the sender at rank 0, engine e at 1 + e), of connection `connection`, due within `timeout_s` (the
    sender's bucket deadline: the engine rank gives the group up after it)."""
    def spec(rank: int, engine: int) -> str:
        part, (flat, offsets) = bucket.ranks[rank], placed[rank]
        return json.dumps(dict(group=group.format(rank=rank), connection=connection, address=address,
                               port=ports[rank], world_size=1 + engines, rank=1 + engine, backend=backend,
                               timeout_s=timeout_s,
                               names=part.names, offsets=offsets, nbytes=flat.numel(),
                               dtypes=[str(t.dtype).removeprefix("torch.") for t in part.tensors],
                               shapes=[list(t.shape) for t in part.tensors]))

    return [[spec(rank, engine) for rank in range(len(bucket.ranks))] for engine in range(engines)]


def round_payloads(entries: list[list[list[str]]], engines: int, ranks: int) -> list[list[str]]:
    """Per engine, per engine rank r, the serialized `receive_shard` payload of a round: every sender's entry for
    rank r (`entries[s][e][r]`, `shard_specs`), in sender order, each with a marker tensor (SGLang hands each rank
    its entry of `serialized_named_tensors`)."""
    from slimish.weight_sync.tensor import serialize

    marker = torch.zeros(1, device="cpu")
    return [[serialize([(entry[engine][rank], marker) for entry in entries]) for rank in range(ranks)]
            for engine in range(engines)]


def _with_timeout(spec: str, timeout_s: float) -> str:
    """A sender's entry due within the round's `timeout_s` rather than its own bucket's."""
    return json.dumps({**json.loads(spec), "timeout_s": timeout_s})


def join_rank_groups(*, backend: str, address: str, ports: list[int], engines: int, group: str,
                     timeout=None, wait: Callable[[Callable[[float], bool]], None] | None = None) -> list:
    """A sender's groups with each engine rank r (`group.format(rank=r)` at `ports[r]`, the sender at rank 0; the
    engines join in `receive_shard`), all at once. `timeout`: of the rendezvous (default: the groups' own,
    `WEIGHT_UPDATE_GROUP_TIMEOUT`). If a group cannot be joined (an engine rank failed the request and never came),
    the others are destroyed and its error raised.

    `wait(done)`: how the caller waits for the rendezvous, `done(timeout_s)` being True once every one has ended (a
    transport's `wait_until`, which raises once the sync is released): what it raises ends the join at once, the
    rendezvous left to end in the background (within `timeout`) and each group it makes destroyed then. Default: until
    every rendezvous has ended."""
    pool = ThreadPoolExecutor(len(ports))
    joins = [pool.submit(new_weight_update_group, backend=backend, master_address=address, master_port=port,
                         world_size=1 + engines, rank=0, group_name=group.format(rank=r), **(
                             {} if timeout is None else {"join_timeout": timeout}))
             for r, port in enumerate(ports)]
    pool.shutdown(wait=False)
    ended = functools.partial(_all_ended, joins)
    try:
        (wait or (lambda done: done(None)))(ended)
    except BaseException:
        for join in joins:  # given up: a group that is still being joined goes once it is
            join.add_done_callback(_destroy_joined)
        raise
    del ended
    failed = [join.exception() for join in joins if join.exception() is not None]
    if not failed:
        return [join.result() for join in joins]
    # An engine rank never came (it failed first): the others' groups go, which ends their receives. A gloo group
    # closes its connections when its last reference goes (destroying it is not enough): none is left here (not even
    # in this frame, which the raised error's traceback keeps).
    joined = [join.result() for join in joins if join.exception() is None]
    del joins
    for group in joined:
        destroy_group(group)
    del joined, group
    raise failed[0]


def _all_ended(joins: list, timeout_s: float | None) -> bool:
    return not wait_futures(joins, timeout=timeout_s).not_done


def _destroy_joined(join) -> None:
    """A join given up by `join_rank_groups`' caller, once it has ended: its group, if it made one, destroyed."""
    if join.exception() is None:
        destroy_group(join.result())
