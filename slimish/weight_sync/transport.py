"""What a weight-sync transport implements: moving one bucket of HF-named tensors into every engine.

The engine protocol around the buckets (begin -> buckets -> the last one flips the version -> end -> verify) is
written once, in `slimish.weight_sync.sync`; a transport only connects, pushes buckets and closes. Transports are
chosen by name (`weight_sync.transport`) from `TRANSPORTS`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from slimish.engines.client import EngineClient
from slimish.weight_sync.buckets import Bucket


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


class Transport(ABC):
    #: The engines must be inside /begin_weight_update ... /end_weight_update around the buckets.
    bracketed: bool = True

    def __init__(self, context: TransportContext):
        self.context = context
        self._phases: Counter = Counter()

    @contextmanager
    def phase(self, name: str):
        """Add the time spent in the block to phase `name` (reported by `pop_phases` as time_<name>_s)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._phases[name] += time.monotonic() - t0

    def pop_phases(self) -> dict[str, float]:
        """Seconds per phase since the last call, e.g. {"time_flatten_s": ..., "time_wire_s": ...}."""
        phases, self._phases = self._phases, Counter()
        return {f"time_{name}_s": seconds for name, seconds in phases.items()}

    def hashing(self, named_tensors, expected):
        """`named_tensors`, each also fed to `expected` (an `ExpectedChecksums`), that time counted as phase 'hash'."""
        for name, tensor in named_tensors:
            with self.phase("hash"):
                expected.add(name, tensor)
            yield name, tensor

    def connect(self, clients: list[EngineClient]) -> None:
        """Set up the link to the engines behind `clients` (once per set of engines). Subclasses extend it."""
        self.clients = clients
        self._pool = ThreadPoolExecutor(max(1, len(clients)))
        self._loading: list[Future] = []  # the engines' answers to the bucket they are loading
        self._loading_keep: object = None  # what must stay alive until they have answered (a shared buffer)

    def on_all(self, fn: Callable[[EngineClient], object]) -> list[Future]:
        """Start `fn(client)` for every engine at once; the futures in engine order."""
        return [self._pool.submit(fn, client) for client in self.clients]

    def loading(self, calls: list[Future], *, keep: object = None) -> None:
        """The engines are loading a bucket (`calls`: their answers to come; `keep`: held until then). Overlapping
        transports call it after starting a bucket and `wait_loaded` before starting the next."""
        self._loading, self._loading_keep = calls, keep

    def wait_loaded(self) -> None:
        """Wait for the engines to answer the bucket they are loading (phase 'engine_load')."""
        with self.phase("engine_load"):
            calls, self._loading = self._loading, []
            for call in calls:
                call.result()
            self._loading_keep = None

    def let_go(self, timeout_s: float = 60.0) -> None:
        """After a failure: wait up to `timeout_s` for each engine to finish or give up the bucket it was loading,
        whatever it answers (the sync has failed already)."""
        calls, self._loading = self._loading, []
        settle(calls, timeout_s)
        self._loading_keep = None

    @abstractmethod
    def push(self, bucket: Bucket, *, version: str | None) -> int:
        """Move `bucket` into every engine; returns its bytes. `version` is given with the last bucket only: the
        engines then take it as their weight version and flush their KV cache."""

    @abstractmethod
    def abort(self) -> None:
        """After a failed push (an engine died): release the engines still waiting for a bucket and drop what the
        sync had staged. The transport is then only good for `close`."""

    def close(self) -> None:
        """Tear the link down (engines may already be gone). Subclasses extend it."""
        self._pool.shutdown(wait=False)


def settle(calls: list[Future], timeout_s: float = 60.0) -> None:
    """Wait up to `timeout_s` for each of `calls` to end, whatever it answers: after a failure, when only the end
    of the engines' part is awaited, not its outcome."""
    for call in calls:
        try:
            call.result(timeout=timeout_s)
        except Exception:  # its failure is not news
            pass


def tensor_meta(bucket: Bucket) -> dict:
    """The names, dtypes and shapes of a bucket's tensors, as SGLang's update endpoints take them."""
    return dict(names=bucket.names, dtypes=[str(t.dtype).removeprefix("torch.") for t in bucket.tensors],
                shapes=[list(t.shape) for t in bucket.tensors])
