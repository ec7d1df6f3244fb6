"""An engine that dies (SIGKILL) or freezes (SIGSTOP) while a bucket of a weight sync is in flight, for each transport,
on the shared SGLang engines (tests/e2e/shared_engines.py): the sync is released within seconds, the engine that
did not answer is named, the sync done again to the other engine verifies, and once the lost engine is back (the
killed one restarted, the frozen one continued after the sync moved on) a whole sync to both verifies every
parameter of both: it rejoins with the full current weights.

Where the fault lands is deterministic: the sync's `in_flight` hook (`weight_sync.in_flight_hook` in a job) signals
engine 1's process group once the engines have been asked for bucket 1 (disk: for the load of the whole model) and
before the sender sends it; whether or not the engine read the request first, it cannot finish it. The test then
plays the job's part: like the watchdog, it watches engine 1's processes (exit, or state T in /proc) and, like the
driver, releases the sync once it sees the fault (`WeightSync.release`). For a kill, the engine's closed connection
may fail the sync first; either way the sync fails at once, naming engine 1. In a job the same is run by the
watchdog and the driver (`slimish.orchestration.sync.EngineSync._watched`); the engine-crash test runs that chain.

Each case prints `stalled_s`: how long the fault held the sync (time_sync_stalled_s in a job's metrics), which the
bucket's deadline bounds by construction (60 s here: `weight_sync.bucket_timeout_s`, the default); the release by
the fault's detection is asserted, not a figure. Cost: ~5 s per frozen case; ~30 s per killed case (the engine's
restart). The sharded route (each engine rank sent only its own parameters) runs the frozen case per transport and
the killed one for broadcast, whose per-rank groups are its own. The frozen engine is continued as soon as the sync
has given up, while it lets the engines' calls end."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time

import pytest
import torch

from slimish.engines.client import EngineError
from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
from slimish.megatron_bridge.hf_io import HFCheckpoint
from slimish.weight_sync.checksums import ExpectedChecksums
from slimish.weight_sync.sender import sync_to
from slimish.weight_sync.sharding import EngineLayout, sharding_of
from slimish.weight_sync.sync import WeightSync
from slimish.weight_sync.transport import SyncReleased

VICTIM = 1


def new_sync(engines, urls: list[str], *, transport: str, workdir, name: str, in_flight=None,
             sharded: bool = False) -> WeightSync:
    """`sharded`: each engine rank sent only its own parameters (weight_sync.sharded; these engines have one rank,
    so the payloads are whole, but they travel the sharded route: its loaders, groups and aborts)."""
    arch = architecture_from_hf(read_hf_config(engines.model))
    layout = EngineLayout(arch, sharding_of(urls[0], api_key=engines.key)) if sharded else None
    sync = sync_to(urls, transport=transport, group_name=name, bucket_bytes=64 << 10, disk_dir=str(workdir / "disk"),
                   api_key=engines.key, expected_checksums=functools.partial(ExpectedChecksums, arch, torch.float32),
                   in_flight=in_flight, layout=layout)
    sync.connect()
    return sync


def tensors(engines):
    checkpoint = HFCheckpoint(engines.model)
    return ((name, checkpoint.get(name)) for name in checkpoint.names())


class FaultInFlight:
    """The `in_flight` hook: at bucket `bucket`, send `signal_name` to the victim's process group, then watch its
    processes (as the watchdog does) and release the sync once the fault shows (as the driver does)."""

    def __init__(self, engines, *, signal_name: str, bucket: int):
        self.engines, self.signal_name, self.bucket = engines, signal_name, bucket
        self.sync: WeightSync | None = None
        self.fired = threading.Event()

    def __call__(self, version: str, index: int, urls: list[str]) -> None:
        if index != self.bucket or self.fired.is_set():
            return
        self.fired.set()
        process = self.engines.processes[VICTIM]
        os.killpg(process.pid, getattr(signal, self.signal_name))
        threading.Thread(target=self._release_when_seen, args=(process,), daemon=True).start()

    def _release_when_seen(self, process) -> None:
        while process.alive() and not process.stopped():
            time.sleep(0.05)
        frozen = process.alive()
        self.sync.release(f"engine {VICTIM} {'froze' if frozen else 'died'}")
        if frozen:  # continued once the sync has given up (while it lets the engines' calls end)
            while not self.sync.broken:
                time.sleep(0.01)
            os.killpg(process.pid, signal.SIGCONT)


# The sharded route (weight_sync.sharded): every transport frozen, and broadcast's per-rank groups killed too.
CASES = [(t, s, False) for s in ("SIGSTOP", "SIGKILL") for t in ("broadcast", "tensor", "disk")] + \
    [(t, "SIGSTOP", True) for t in ("broadcast", "tensor", "disk")] + [("broadcast", "SIGKILL", True)]


@pytest.mark.parametrize(("transport", "signal_name", "sharded"), CASES,
                         ids=[f"{t}-{s}" + ("-sharded" if sh else "") for t, s, sh in CASES])
def test_a_bucket_in_flight_to_a_lost_engine_releases_the_sync(attached, tmp_path, transport, signal_name, sharded):
    engines = attached
    victim = engines.urls[VICTIM]
    fault = FaultInFlight(engines, signal_name=signal_name, bucket=0 if transport == "disk" else 1)
    sync = fault.sync = new_sync(engines, engines.urls, transport=transport, workdir=tmp_path, name="faulty",
                                 in_flight=fault, sharded=sharded)
    try:
        with pytest.raises(RuntimeError) as failure:  # SyncReleased, or what the killed engine's sockets raise
            sync.send(tensors(engines), version=f"{transport}-fault")
        print(f"\n{transport} {signal_name}: stalled_s {sync.stalled_s:.3f} ({type(failure.value).__name__})")
        assert fault.fired.is_set()
        if isinstance(failure.value, SyncReleased):
            assert not failure.value.by_deadline, "released by the fault's detection, not the deadline"
            # The victim had not answered; the other engine may not have yet either (released within milliseconds).
            assert victim in failure.value.unanswered, failure.value
        else:  # its HTTP call, or (broadcast) the collective, failed as its sockets closed
            assert signal_name == "SIGKILL", failure.value
            assert isinstance(failure.value, EngineError) and victim in str(failure.value) \
                or "Connection reset by peer" in str(failure.value) or "Connection closed" in str(failure.value), \
                failure.value
        assert 0 <= sync.stalled_s < 60 + 1
        # Done again to the other engine: verified.
        rerun(engines, engines.urls[:VICTIM], transport=transport, workdir=tmp_path, name="survivor", sharded=sharded)
        # The lost engine back, then a whole sync to both: every parameter of both verified. (A continued engine
        # finished the given-up request first: SGLang serves weight updates one at a time.)
        if signal_name == "SIGKILL":
            engines.restart(VICTIM)
        rerun(engines, engines.urls, transport=transport, workdir=tmp_path, name="rejoined", sharded=sharded)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever happened, nothing stays frozen
            os.killpg(engines.processes[VICTIM].pid, signal.SIGCONT)
        sync.close()  # last: the given-up sync's shards (disk) stay until then


def rerun(engines, urls: list[str], *, transport: str, workdir, name: str, sharded: bool = False) -> None:
    sync = new_sync(engines, urls, transport=transport, workdir=workdir, name=name, sharded=sharded)
    try:
        assert sync.send(tensors(engines), version=f"{transport}-{name}")["sync_buckets"] >= 1
    finally:
        sync.close()
