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

from slimish.rollout.engine_client import EngineClient
from slimish.weight_sync.broadcast import BroadcastTransport
from slimish.weight_sync.buckets import plan_buckets
from slimish.weight_sync.checksums import ExpectedChecksums, differing
from slimish.weight_sync.disk import DiskTransport
from slimish.weight_sync.tensor import TensorTransport
from slimish.weight_sync.transport import Transport, TransportContext, settle

TRANSPORTS: dict[str, type[Transport]] = {"broadcast": BroadcastTransport, "tensor": TensorTransport,
                                          "disk": DiskTransport}


class WeightSyncError(RuntimeError):
    """The engines do not hold the weights the trainer sent; the message names the engines and the parameters."""


class WeightSync:
    """`verify`: check the engines after every sync. `expected_checksums`: makes the object that computes, from the
    tensors sent, every engine parameter's checksum (None when the engines' layout is not known to
    `slimish.weight_sync.checksums`: the engines are then checked against each other). `after_bucket(version,
    index, engine_urls)` is called after each bucket but the last is on its way (the weight_sync.after_bucket_hook)."""

    def __init__(self, *, transport: str, context: TransportContext, engine_urls: list[str], bucket_bytes: int,
                 verify: bool = True, expected_checksums: Callable[[], ExpectedChecksums] | None = None,
                 after_bucket: Callable[[str, int, list[str]], None] | None = None):
        self.clients = [EngineClient(url) for url in engine_urls]
        self.transport = TRANSPORTS[transport](context)
        self.bucket_bytes, self.verify = bucket_bytes, verify
        self.expected_checksums = expected_checksums if verify else None
        self.after_bucket = after_bucket
        self.broken = False

    def _on_all(self, fn) -> list:
        return [future.result() for future in self.transport.on_all(fn)]

    def connect(self) -> None:
        self.transport.connect(self.clients)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: str) -> dict:
        """Send the whole model (`named_tensors`, consumed lazily) to every engine as weight version `version`.

        If an engine fails during it (it died), the engines still waiting for a bucket are released, every engine's
        update session is ended, and the error is raised: this object is then only good for `close`, and the caller
        syncs again with a new one to the engines that are left. `named_tensors` may be left part-consumed."""
        if self.broken:
            raise RuntimeError("this WeightSync failed during an earlier sync: connect a new one")
        try:
            return self._send(named_tensors, version=version)
        except WeightSyncError:
            raise  # the engines answered, with the wrong weights: nothing to release
        except BaseException:
            self.broken = True
            self.transport.abort()
            if self.transport.bracketed:  # close the survivors' sessions; the dead engine's call fails, unheard
                settle(self.transport.on_all(lambda c: c.end_weight_update()))
            raise

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: str) -> dict:
        t0 = time.monotonic()
        if self.transport.bracketed:
            with self.transport.phase("control"):
                self._on_all(lambda c: c.begin_weight_update())
        num_buckets, num_bytes = 0, 0
        pending = None
        expected = self.expected_checksums() if self.expected_checksums else None
        tensors = self._timed_export(named_tensors)
        if expected is not None:
            tensors = self._hashed(tensors, expected)
        for bucket in plan_buckets(tensors, self.bucket_bytes):
            # Hold one bucket back so the last one, which flips the version, is known when it is sent.
            if pending is not None:
                num_bytes += self.transport.push(pending, version=None)
                if self.after_bucket is not None:
                    self.after_bucket(version, num_buckets, [c.url for c in self.clients])
                num_buckets += 1
            pending = bucket
        if pending is not None:
            num_bytes += self.transport.push(pending, version=version)
            num_buckets += 1
        if self.transport.bracketed:
            with self.transport.phase("control"):
                self._on_all(lambda c: c.end_weight_update())
        t1 = time.monotonic()
        if self.verify:
            self._verify(version, expected.result() if expected is not None else None)
        return {"sync_buckets": num_buckets, "sync_mib": num_bytes / 2**20, "time_transfer_s": t1 - t0,
                "time_verify_s": time.monotonic() - t1, **self.transport.pop_phases()}

    def _verify(self, version: str, expected: dict[str, str] | None) -> None:
        """Raise WeightSyncError unless every engine reports `version` and holds `expected` (or, when None, what the
        first engine holds)."""
        versions = self._on_all(lambda c: c.weight_version())
        wrong = {c.url: v for c, v in zip(self.clients, versions) if v != version}
        if wrong:
            raise WeightSyncError(f"weight sync to version {version}: engines report {wrong}")
        held = self._on_all(lambda c: c.weight_checksums())
        against = "the trainer sent" if expected is not None else "engine 0 holds"
        for client, ranks in zip(self.clients, held):
            for tp_rank, checksums in enumerate(ranks):
                bad = differing(expected if expected is not None else held[0][tp_rank], checksums)
                if bad:
                    shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                    raise WeightSyncError(
                        f"weight sync to version {version}: engine {client.url} (tensor-parallel rank {tp_rank}) "
                        f"holds other values than {against} in {len(bad)} parameter(s): {shown}")

    def _hashed(self, tensors, expected: ExpectedChecksums):
        """`tensors`, each also fed to `expected` (phase 'hash')."""
        for name, tensor in tensors:
            with self.transport.phase("hash"):
                expected.add(name, tensor)
            yield name, tensor

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
