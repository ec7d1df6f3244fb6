"""What a weight-sync transport implements: moving one bucket of HF-named tensors into every engine.

The engine protocol around the buckets (begin -> buckets -> the last one flips the version -> end -> verify) is
written once, in `slimish.weight_sync.sync`; a transport only connects, pushes buckets and closes. Transports are
chosen by name (`weight_sync.transport`) from `TRANSPORTS`.

No wait of a transport is unbounded (issue "a weight sync that cannot hang"): every wait on the engines' answers or
on a collective is cut into slices, and ends early with `SyncReleased` when
- `release(reason)` was called, from any thread: the job's engine set saw an engine of this sync die or freeze
  (the driver's watch, `slimish.orchestration.driver`), or
- the bucket outlived its deadline: `bucket_timeout_s` plus its bytes at `min_bandwidth_mib_s` (the context's), a
  backstop for a stall nothing else notices.
The sync is then given up (`abort`) and done again, whole, to the engines that are left.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from dataclasses import dataclass

from slimish.engines.client import EngineClient
from slimish.weight_sync.buckets import Bucket, ShardedBucket


@dataclass(frozen=True, kw_only=True)
class TransportContext:
    """Where a transport runs: the trainer's side of the link to the engines."""
    master_addr: str      # the trainer rank's address, reachable from the engines
    master_port: int      # a free port there (rendezvous of a process group)
    backend: str          # torch.distributed backend: gloo on CPU, nccl on GPU
    group_name: str       # unique per (re)connection
    engine_tp: int        # tensor-parallel ranks per engine
    disk_dir: str         # a directory the engines can read (the disk transport)
    api_key: str | None = None  # the job's key, which the engines' control endpoints require
    bucket_timeout_s: float = 60.0      # a bucket's deadline: this ...
    min_bandwidth_mib_s: float = 32.0   # ... plus its size at this rate (weight_sync.* of the same names)


WAIT_SLICE_S = 0.25   # how often a waiting sender looks at `release` and its deadline
LET_GO_S = 10.0       # after a release: how long the survivors' calls are given to end


# (work, its group) of the collectives senders gave up on, kept until the work ends: the last reference to a gloo
# group runs its destructor, which joins the group's thread, blocked in the given-up send until the group's timeout
# (seen here: a sender blocked in `self.group = None` after a release, gdb showing ~ProcessGroupGloo joining it).
GIVEN_UP: list = []


def keep_until_done(work, group) -> None:
    GIVEN_UP[:] = [(w, g) for w, g in GIVEN_UP if not w.is_completed()] + [(work, group)]


@dataclass(frozen=True)
class Owned:
    """A bucket another sender staged itself (a later stage's leader or an expert owner, `slimish.weight_sync.owners`),
    as rank 0 posts it: what names it per engine and engine rank (`shards`, by transport), its bytes per engine rank,
    `go()` once the engines have loaded it (the sender may reuse what it staged), `wire()` once they have been asked
    for it (broadcast: the sender broadcasts it then)."""
    shards: object
    rank_bytes: list[int]
    go: Callable[[], None]
    wire: Callable[[], None] | None = None


class SyncReleased(RuntimeError):
    """A wait of the sync was given up: `release` was called, or a bucket outlived its deadline. `stalled_s`: how
    long the sync had made no progress when it was released (metric time_sync_stalled_s)."""

    def __init__(self, message: str, *, stalled_s: float, by_deadline: bool):
        super().__init__(message)
        self.stalled_s, self.by_deadline = stalled_s, by_deadline
        self.unanswered: list[str] = []  # engines whose answer was awaited then (see `Transport.results`)


class PhaseTimes:
    """Seconds spent per named phase of a sender's sync (flatten, wire, hash, ...), added up by `phase` and taken by
    `pop` as metrics (time_<name>_s)."""

    def __init__(self):
        self._seconds: Counter = Counter()

    @contextmanager
    def phase(self, name: str):
        """Add the time spent in the block to phase `name`."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._seconds[name] += time.monotonic() - t0

    def pop(self) -> dict[str, float]:
        """Seconds per phase since the last call, e.g. {"time_flatten_s": ..., "time_wire_s": ...}."""
        seconds, self._seconds = self._seconds, Counter()
        return {f"time_{name}_s": value for name, value in seconds.items()}


def hashing_shards(shards, expected, phases: PhaseTimes):
    """The sharded sync's (rank, engine parameter, tensor) items, each also fed to `expected`
    (`ExpectedChecksums.add_shard`), that time counted as phase 'hash' of `phases`."""
    for rank, name, tensor in shards:
        with phases.phase("hash"):
            expected.add_shard(rank, name, tensor)
        yield rank, name, tensor


class Transport(ABC):
    #: The engines must be inside /begin_weight_update ... /end_weight_update around the buckets.
    bracketed: bool = True

    def __init__(self, context: TransportContext):
        self.context = context
        self._phases = PhaseTimes()
        self._released = threading.Event()
        self._release_reason = ""
        self.progress_at = time.monotonic()  # the last time a wait of this sync ended
        # Called with a bucket's index (in this sync) once the engines have been asked for it and before it is sent:
        # the bucket is in flight (weight_sync.in_flight_hook, set by the sync).
        self.in_flight: Callable[[int], None] | None = None
        self._loading: list[Future] = []  # the engines' answers to the bucket they are loading
        self._loading_keep: object = None  # what must stay alive until they have answered (a shared buffer)
        self._loading_deadline = float("inf")
        self.requests = 0  # weight-update requests the engines have been asked (a round is one; in_flight's index)
        self.given_up = None  # the collective `wait_work` gave up on, if any
        self.hung: list[str] = []  # engines `abort` found unable to let go (the job kills and restarts them)

    def start_sync(self) -> None:
        """Before each sync's first bucket: the stall clock and the request count start over."""
        self.progress_at = time.monotonic()
        self.requests = 0

    # ------------------------------------------------------------------------------ bounded waits
    def release(self, reason: str) -> None:
        """From any thread: make the wait the sender is in (and every later one) raise `SyncReleased`."""
        self._release_reason = reason
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def deadline(self, nbytes: int) -> float:
        """The monotonic time by which a bucket of `nbytes` started now must be on the engines."""
        ctx = self.context
        return time.monotonic() + ctx.bucket_timeout_s + nbytes / (ctx.min_bandwidth_mib_s * 2**20)

    def wait_until(self, done: Callable[[float], bool], *, deadline: float, what: str) -> None:
        """Call `done(timeout_s)` (True once what is awaited has happened; it may block up to `timeout_s`) until it
        is True; `SyncReleased` if `release` is called or `deadline` passes first. The caller moves `progress_at`
        once what it awaited has succeeded."""
        while not self._released.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                stalled = time.monotonic() - self.progress_at
                raise SyncReleased(f"weight sync: {what} not done by its deadline (no progress for {stalled:.1f} s; "
                                   f"weight_sync.bucket_timeout_s, weight_sync.min_bandwidth_mib_s)",
                                   stalled_s=stalled, by_deadline=True)
            if done(min(left, WAIT_SLICE_S)):
                return
        stalled = time.monotonic() - self.progress_at
        raise SyncReleased(f"weight sync released while waiting for {what} (no progress for {stalled:.1f} s): "
                           f"{self._release_reason}", stalled_s=stalled, by_deadline=False)

    def results(self, calls: list[Future], *, deadline: float, what: str) -> list:
        """The results of `calls` (one per engine, in engine order, as `on_all` makes them; raising the first
        failure), waited for with `wait_until`. Given up, the `SyncReleased` names the engines that had not
        answered (`unanswered`): past a deadline, those are hung, whatever else they answer."""
        try:
            self.wait_until(lambda timeout: not wait_futures(calls, timeout=timeout).not_done, deadline=deadline,
                            what=what)
        except SyncReleased as exc:
            exc.unanswered = self.unanswered(calls)
            raise
        results = [call.result() for call in calls]
        self.progress_at = time.monotonic()  # only once every engine has answered well
        return results

    def unanswered(self, calls: list[Future]) -> list[str]:
        """The engines whose call of `calls` (one per engine, in engine order) has not ended."""
        return [client.url for client, call in zip(self.clients, calls) if not call.done()]

    def wait_work(self, work, *, deadline: float, what: str) -> None:
        """Wait for a torch.distributed Work (an async collective) with `wait_until`, then raise its failure if it
        failed. A work given up stays pending (a gloo send to a frozen receiver, or to one killed while the send was
        blocked on it, never ends before its group's timeout); its group is not used again, and must outlive it
        (see `BroadcastTransport.abort`)."""
        def finished(timeout: float) -> bool:
            end = time.monotonic() + timeout
            while not work.is_completed():
                if time.monotonic() >= end:
                    return False
                time.sleep(0.002)
            return True

        try:
            self.wait_until(finished, deadline=deadline, what=what)
        except SyncReleased as exc:
            self.given_up = work
            # Which peer holds a collective up cannot be told; the engines yet to answer the bucket can.
            exc.unanswered = self.unanswered(self._loading)
            raise
        work.wait()
        self.progress_at = time.monotonic()

    # ------------------------------------------------------------------------------ phases, engines
    def phase(self, name: str):
        """Add the time spent in the block to phase `name` (reported by `pop_phases` as time_<name>_s)."""
        return self._phases.phase(name)

    def pop_phases(self) -> dict[str, float]:
        """Seconds per phase since the last call, e.g. {"time_flatten_s": ..., "time_wire_s": ...}."""
        return self._phases.pop()

    def hashing(self, named_tensors, expected):
        """`named_tensors`, each also fed to `expected` (an `ExpectedChecksums`), that time counted as phase 'hash'."""
        for name, tensor in named_tensors:
            with self.phase("hash"):
                expected.add(name, tensor)
            yield name, tensor

    def hashing_shards(self, shards, expected):
        """The sharded sync's (rank, engine parameter, tensor) items, each also fed to `expected`
        (`ExpectedChecksums.add_shard`), that time counted as phase 'hash'."""
        return hashing_shards(shards, expected, self._phases)

    def connect(self, clients: list[EngineClient]) -> None:
        """Set up the link to the engines behind `clients` (once per set of engines). Subclasses extend it."""
        self.clients = clients
        self._pool = ThreadPoolExecutor(max(1, len(clients)))

    def on_all(self, fn: Callable[[EngineClient], object]) -> list[Future]:
        """Start `fn(client)` for every engine at once; the futures in engine order."""
        return [self._pool.submit(fn, client) for client in self.clients]

    def loading(self, calls: list[Future], *, deadline: float, keep: object = None) -> None:
        """The engines are loading a bucket (`calls`: their answers to come, due by `deadline`; `keep`: held until
        then). Overlapping transports call it after starting a bucket and `wait_loaded` before starting the next.
        Then `in_flight` (the test hook) runs: the engines have been asked for the bucket, which is not sent yet."""
        self._loading, self._loading_keep, self._loading_deadline = calls, keep, deadline
        if self.in_flight is not None:
            self.in_flight(self.requests)
        self.requests += 1

    def wait_loaded(self) -> None:
        """Wait for the engines to answer the bucket they are loading (phase 'engine_load')."""
        with self.phase("engine_load"):
            self.results(self._loading, deadline=self._loading_deadline, what="the engines' answers to a bucket")
            self._loading, self._loading_keep = [], None

    def let_go(self, timeout_s: float = 60.0) -> None:
        """After a failure: wait up to `timeout_s` for each engine to finish or give up the bucket it was loading,
        whatever it answers (the sync has failed already); `LET_GO_S` after a release (the engine that caused it
        may never answer)."""
        calls, self._loading = self._loading, []
        self.settle(calls, timeout_s)
        self._loading_keep = None

    def settle(self, calls: list[Future], timeout_s: float = 60.0) -> None:
        """`settle(calls, timeout_s)`, or within `LET_GO_S` after a release (the engine that caused it may never
        answer)."""
        settle(calls, min(timeout_s, LET_GO_S) if self.released else timeout_s)

    @abstractmethod
    def push(self, bucket: Bucket, *, version: str | None) -> int:
        """Move `bucket` into every engine; returns its bytes. `version` is given with the last bucket only: the
        engines then take it as their weight version and flush their KV cache."""

    #: The transport can send each engine rank its own shard (`push_shards`; the sharded sync) ...
    shards: bool = False
    #: ... through this engine-side loader, which the engines must list in --custom-weight-loader ("": none).
    shard_loader: str = ""
    #: This sync sends shards (set by the sync, before `connect`) ...
    sharded: bool = False
    #: ... which SGLang's stock load_format="direct" loads (else the model post-processes loaded weights: MLA).
    direct_load: bool = True

    @classmethod
    def shards_under_auto(cls, backend: str) -> bool:
        """`weight_sync.sharded` auto picks the sharded route with this transport when the trainer's collectives run
        on `backend` (else only 'on' does)."""
        return True

    def push_shards(self, bucket: ShardedBucket, *, version: str | None) -> int:
        """Move each rank's part of `bucket` into that tensor-parallel rank of every engine (engine parameters, in
        SGLang's layout, copied in by name); returns the bytes this sender staged (all ranks' parts). `version` as
        for `push`."""
        raise NotImplementedError(f"{type(self).__name__} sends the full model only")

    def push_owned(self, shards, *, rank_bytes: list[int], go: Callable[[], None],
                   wire: Callable[[], None] | None = None) -> None:
        """Post a bucket of per-rank shards an expert owner staged itself (`slimish.weight_sync.owners`; what names
        it, by transport), and call `go` once the owner may drop or reuse what it staged. `wire`: called once the
        engines have been asked for it, for a transport whose owner then sends it (broadcast)."""
        raise NotImplementedError(f"{type(self).__name__} does not take experts from their owners")

    def push_round(self, own: ShardedBucket | None, owned: list[Owned]) -> int:
        """One round of the sharded sync from several senders (`slimish.weight_sync.owners`): rank 0's own bucket
        `own` (None: none this round) and the next bucket of each other sender in `owned`. By default they are posted
        one after the other; a transport whose engines can take them in one request does (broadcast: each engine
        rank receives its part from every sender at once). Returns the bytes rank 0 staged."""
        nbytes = self.push_shards(own, version=None) if own is not None else 0
        for bucket in owned:
            self.push_owned(bucket.shards, rank_bytes=bucket.rank_bytes, go=bucket.go, wire=bucket.wire)
        return nbytes

    @abstractmethod
    def abort(self) -> None:
        """After a failed push (an engine died): release the engines still waiting for a bucket and drop what the
        sync had staged. The transport is then only good for `close`."""

    def close(self) -> None:
        """Tear the link down (engines may already be gone). Subclasses extend it."""
        self._pool.shutdown(wait=False)


def settle(calls: list[Future], timeout_s: float = 60.0) -> None:
    """Wait up to `timeout_s` in all for `calls` to end, whatever they answer: after a failure, when only the end of
    the engines' part is awaited, not its outcome."""
    wait_futures(calls, timeout=timeout_s)


def tensor_meta(bucket: Bucket) -> dict:
    """The names, dtypes and shapes of a bucket's tensors, as SGLang's update endpoints take them."""
    return dict(names=bucket.names, dtypes=[str(t.dtype).removeprefix("torch.") for t in bucket.tensors],
                shapes=[list(t.shape) for t in bucket.tensors])
