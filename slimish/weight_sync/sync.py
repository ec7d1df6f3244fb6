"""The engine side of a weight sync, written once for every transport:

  begin (`/begin_weight_update`, when the transport is bracketed) -> every bucket through the transport, the last one
  carrying the new weight version (the engines flip to it and flush their KV cache) -> end (`/end_weight_update`)
  -> verify: every engine reports the new version in `/model_info`, and every parameter it holds has the checksum
  the sender computed from the tensors it sent (`slimish.weight_sync.checksums`; for layouts it does not know,
  every engine must hold what the first one holds).

Pausing generation around it (retract mode) is the rollout side's job (the driver calls it); the engines handed to
a `WeightSync` are the ones the sync must reach. `TRANSPORTS` maps `weight_sync.transport` to its class.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from slimish.engines import timeouts
from slimish.engines.client import EngineClient
from slimish.weight_sync.broadcast import BroadcastTransport
from slimish.weight_sync.buckets import ShardedBucket, plan_buckets, plan_sharded_buckets
from slimish.weight_sync.checksums import ExpectedChecksums, differing, merged
from slimish.weight_sync.disk import DiskTransport
from slimish.weight_sync.sharding import EngineLayout, EngineShards
from slimish.weight_sync.stages import StageLink
from slimish.weight_sync.tensor import TensorTransport
from slimish.weight_sync.transport import Owned, SyncReleased, Transport, TransportContext

TRANSPORTS: dict[str, type[Transport]] = {"broadcast": BroadcastTransport, "tensor": TensorTransport,
                                          "disk": DiskTransport}


class WeightSyncError(RuntimeError):
    """The engines do not hold the weights the trainer sent; the message names the engines and the parameters."""


class WeightSync:
    """`verify`: check the engines after every sync. `expected_checksums`: makes the object that computes, from the
    tensors sent, every engine parameter's checksum (None when the engines' layout is not known to
    `slimish.weight_sync.checksums`: the engines are then checked against each other). `after_bucket(version,
    index, engine_urls)` is called after each bucket but the last is on its way (the weight_sync.after_bucket_hook);
    `in_flight(version, index, engine_urls)` once the engines have been asked for a bucket of this rank's and before
    it is sent (the weight_sync.in_flight_hook; with the disk transport, index 0: the one load of the whole model).
    `new_client(url, api_key=...)` makes the client of each engine (`EngineClient`; a stand-in in unit tests).
    `layout`: the engines' `EngineLayout` for the sharded route (each engine rank is sent only the engine parameters
    it holds, `EngineShards`; the transport must have `shards`); None: the full model to every rank. `rank`: the
    sending trainer rank, whose staged bytes `sync_sent_rank<rank>_mib` reports (each stage's or expert owner's under
    its own rank)."""

    def __init__(self, *, transport: str, context: TransportContext, engine_urls: list[str], bucket_bytes: int,
                 verify: bool = True, expected_checksums: Callable[[], ExpectedChecksums] | None = None,
                 after_bucket: Callable[[str, int, list[str]], None] | None = None,
                 in_flight: Callable[[str, int, list[str]], None] | None = None,
                 new_client: Callable[..., EngineClient] = EngineClient, layout: EngineLayout | None = None,
                 rank: int = 0):
        self.rank = rank  # this sender's trainer rank (metrics: sync_sent_rank<rank>_mib)
        self.clients = [new_client(url, api_key=context.api_key) for url in engine_urls]
        self.transport = TRANSPORTS[transport](context)
        if layout is not None and not self.transport.shards:
            raise ValueError(f"the {transport} transport cannot send shards (weight_sync.sharded)")
        self.layout = layout
        self.transport.sharded = layout is not None
        self.transport.direct_load = layout is None or layout.direct_loadable
        self.bucket_bytes, self.verify = bucket_bytes, verify
        self.expected_checksums = expected_checksums if verify else None
        self.after_bucket, self.in_flight = after_bucket, in_flight
        self.broken = False
        self.sending = False
        self.stalled_s = 0.0  # of the failed send: how long it had made no progress when it failed
        self.hung: list[str] = []  # of the failed send: engines that had not answered by a bucket's deadline

    def _on_all(self, fn, what: str) -> list:
        """`fn(client)` on every engine at once; their results, waited for until `release` or WEIGHT_UPDATE_S."""
        return self.transport.results(self.transport.on_all(fn), what=what,
                                      deadline=time.monotonic() + timeouts.WEIGHT_UPDATE_S)

    def release(self, reason: str) -> None:
        """From any thread, while `send` runs: give the sync up wherever it waits (an engine of it died or froze);
        `send` then raises `SyncReleased`. Ignored when no sync runs (one that ended meanwhile stands)."""
        if self.sending:
            self.transport.release(reason)

    def connect(self) -> None:
        self.transport.connect(self.clients)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: str,
             stages: list[StageLink] = ()) -> dict:
        """Send the whole model to every engine as weight version `version`: `named_tensors` (consumed lazily), and
        with `stages` (broadcast transport only) the buckets each later pipeline stage's sender broadcasts itself,
        taking turns with this rank's (`slimish.weight_sync.stages`).

        If an engine fails during it (it died), or `release` is called (from another thread: an engine of the sync
        died or froze) or a bucket outlives its deadline (`SyncReleased`), the engines still waiting for a bucket
        are released, every engine's update session is ended, and the error is raised (`stalled_s`: how long the
        sync had made no progress then): this object is then only good for `close`, and the caller syncs again with
        a new one to the engines that are left. `named_tensors` may be left part-consumed."""
        if self.broken:
            raise RuntimeError("this WeightSync failed during an earlier sync: connect a new one")
        for link in stages:
            link.start()
        self.transport.start_sync()
        if self.in_flight is not None:
            urls = [c.url for c in self.clients]
            self.transport.in_flight = lambda index: self.in_flight(version, index, urls)
        self.sending = True
        try:
            return self._send(named_tensors, version=version, stages=list(stages))
        except WeightSyncError:
            raise  # the engines answered, with the wrong weights: nothing to release
        except BaseException as exc:
            self.stalled_s = time.monotonic() - self.transport.progress_at
            self.hung = exc.unanswered if isinstance(exc, SyncReleased) and exc.by_deadline else []
            self.broken = True
            for link in stages:  # an owner broadcasting holds engines inside its groups: it lets them go first
                link.interrupt()
            self.transport.abort()
            self.hung += [url for url in self.transport.hung if url not in self.hung]
            if any(link.after_own for link in stages):
                # The first stage's owners send their first bucket only once this rank's export has passed its
                # gathers of the parameters outside the experts, which theirs need: finish it, so that each can be
                # told to give up.
                drain(named_tensors)
            # In list order: a stage's leader before the stage's other senders, whose next bucket may wait on one of
            # the leader's gathers, which it finishes once told to give up.
            stage_failures = [failure for link in stages if (failure := link.release())]
            if self.transport.bracketed:  # close the survivors' sessions; the dead engine's call fails, unheard
                self.transport.settle(self.transport.on_all(lambda c: c.end_weight_update()))
            if stage_failures and not isinstance(exc, SyncReleased):  # the cause, rather than the engines' failed
                raise RuntimeError("; ".join(stage_failures)) from exc  # receive it led to
            raise
        finally:
            self.sending = False

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: str,
              stages: list[StageLink]) -> dict:
        t0 = time.monotonic()
        if self.transport.bracketed:
            with self.transport.phase("control"):
                self._on_all(lambda c: c.begin_weight_update(), "/begin_weight_update")
        tp = self.transport.context.engine_tp
        sent = {"buckets": 0, "bytes": 0, "ranks": [0] * tp, "senders": {self.rank: 0}}

        def count(nbytes: int, *, rank_bytes: list[int] | None = None, last: bool = False,
                  sender: int | None = None) -> None:
            sender = self.rank if sender is None else sender
            if self.after_bucket is not None and not last:
                self.after_bucket(version, sent["buckets"], [c.url for c in self.clients])
            sent["buckets"] += 1
            sent["bytes"] += nbytes
            sent["senders"][sender] = sent["senders"].get(sender, 0) + nbytes  # by trainer rank
            # What each engine rank receives: its own part of a sharded bucket, else the whole bucket.
            for rank, received in enumerate(rank_bytes or [nbytes] * tp):
                sent["ranks"][rank] += received

        def push(bucket, *, version: str | None) -> None:
            if isinstance(bucket, ShardedBucket):
                count(self.transport.push_shards(bucket, version=version), rank_bytes=bucket.rank_bytes,
                      last=version is not None)
            else:
                count(self.transport.push(bucket, version=version), last=version is not None)

        expected = self.expected_checksums() if self.expected_checksums else None
        tensors = self._timed_export(named_tensors)
        if self.layout is None:
            if expected is not None:
                tensors = self.transport.hashing(tensors, expected)
            own = plan_buckets(tensors, self.bucket_bytes)
        else:  # the sharded route: per engine rank, its engine parameters (hashed as sent)
            shards = EngineShards(self.layout).stream(tensors)
            if expected is not None:
                shards = self.transport.hashing_shards(shards, expected)
            own = plan_sharded_buckets(shards, tp, self.bucket_bytes)
        stage_checksums, stage_phases = [], []
        pending, own_left, remote = None, True, list(stages)
        while own_left or remote:
            # A round: one bucket of this rank's and the next of each other sender that may be waited for (every
            # engine sees this order). The sharded route posts the round's shards together (`push_round`).
            own_now, owned = None, []
            if own_left:
                bucket = next(own, None)
                own_left = bucket is not None
                if own_left:
                    # Hold one bucket back so the last one, which flips the version, is known when it is sent.
                    if pending is not None and self.layout is None:
                        push(pending, version=None)
                    elif pending is not None:
                        own_now = pending
                    pending = bucket
            for link in list(remote):
                # Its next bucket may wait on a gather that others hold up: see `slimish.weight_sync.owners`.
                if not link.ready(not own_left or getattr(named_tensors, "dense_over", False)):
                    continue
                message = link.next()
                if "bucket" in message:
                    self.transport.push_remote(message["bucket"], nbytes=message["nbytes"], group_name=link.group_name,
                                               go=lambda link=link: link.reply(True))
                    count(message["nbytes"], sender=link.rank)
                elif "shards" in message:
                    owned.append((link, message))
                elif "done" in message:
                    remote.remove(link)
                    if message["done"] is not None:
                        stage_checksums.append(message["done"])
                    stage_phases.append((link.label, message["phases"]))
                else:
                    raise RuntimeError(message["failed"])
            if owned or own_now is not None:
                nbytes = self.transport.push_round(own_now, [
                    Owned(message["shards"], message["rank_bytes"], go=lambda link=link: link.reply(True),
                          wire=link.wire) for link, message in owned])
                if own_now is not None:
                    count(nbytes, rank_bytes=own_now.rank_bytes)
                for link, message in owned:
                    count(message["nbytes"], rank_bytes=message["rank_bytes"], sender=link.rank)
        if pending is not None:
            push(pending, version=version)
        if self.transport.bracketed:
            with self.transport.phase("control"):
                self._on_all(lambda c: c.end_weight_update(), "/end_weight_update")
        t1 = time.monotonic()
        if self.verify:
            checksums = None
            if expected is not None:
                # each stage's per-rank checksums of its own layers, each owner's of (or partials of) its experts
                checksums = merged(expected.result(), stage_checksums)
            self.check_engines(version, checksums)
        stage_metrics = {f"{key.removesuffix('_s')}_{label}_s": seconds
                         for label, phases in stage_phases for key, seconds in phases.items()}
        per_rank = {f"sync_engine_rank{rank}_mib": received / 2**20 for rank, received in enumerate(sent["ranks"])}
        per_rank |= {f"sync_sent_rank{rank}_mib": nbytes / 2**20 for rank, nbytes in sent["senders"].items()}
        return {"sync_buckets": sent["buckets"], "sync_requests": self.transport.requests,
                "sync_mib": sent["bytes"] / 2**20, "sync_senders": 1 + len(stages),
                "sync_sharded": int(self.layout is not None),
                "sync_expert_slots": int(self.layout is not None and self.layout.expert_slots), **per_rank,
                "sync_checksums_predicted": int(expected is not None),
                "time_transfer_s": t1 - t0, "time_verify_s": time.monotonic() - t1, **self.transport.pop_phases(),
                **stage_metrics}

    def check_engines(self, version: str, expected: list[dict[str, str]] | None) -> None:
        """Raise WeightSyncError unless every engine reports `version` and each of its tensor-parallel ranks holds
        `expected[rank]` (or, when None, what the first engine's rank holds)."""
        versions = self._on_all(lambda c: c.weight_version(), "the engines' weight versions")
        wrong = {c.url: v for c, v in zip(self.clients, versions) if v != version}
        if wrong:
            raise WeightSyncError(f"weight sync to version {version}: engines report {wrong}")
        held = self._on_all(lambda c: c.weight_checksums(), "the engines' checksums")
        against = "the trainer sent" if expected is not None else "engine 0 holds"
        for client, ranks in zip(self.clients, held):
            for tp_rank, checksums in enumerate(ranks):
                bad = differing(expected[tp_rank] if expected is not None else held[0][tp_rank], checksums)
                if bad:
                    shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                    raise WeightSyncError(
                        f"weight sync to version {version}: engine {client.url} (tensor-parallel rank {tp_rank}) "
                        f"holds other values than {against} in {len(bad)} parameter(s): {shown}")

    def _timed_export(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """`named_tensors`, with the time spent producing them (the export's gathers) counted as phase 'export'."""
        items = iter(named_tensors)
        while True:
            with self.transport.phase("export"):
                item = next(items, None)
            if item is None:
                return
            yield item

    def close(self) -> None:
        self.transport.close()
        for client in self.clients:
            client.close()


def drain(tensors: Iterable) -> None:
    """Finish an export's iteration: ranks that send nothing only feed its gathers, and after a failed send the
    senders finish them too, so no rank is left inside a collective. (After a whole send there is nothing left.)"""
    for _ in tensors:
        pass
