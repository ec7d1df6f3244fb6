"""Weight sync over a torch.distributed broadcast group: trainer rank 0 -> every SGLang engine.

Contract (the same on CPU/gloo and GPU/NCCL; only the backend string differs):
  1. connect(): every engine joins group `group_name` (ranks 1..N*tp) while rank 0 hosts the rendezvous.
  2. send(): engines are idle (the caller has no generation in flight, or has paused them);
     begin_weight_update on every engine -> for each bucket: every engine is told the bucket's names, dtypes and
     shapes over HTTP while rank 0 broadcasts one flat uint8 tensor (SGLang's "flattened_bucket" layout:
     the tensors' bytes concatenated in order) -> the last bucket carries the new weight version and flushes the
     KV cache -> end_weight_update -> (verify) every engine reports the new version.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from slimish.rollout.engine_client import EngineClient
from slimish.weight_sync.buckets import Bucket, plan_buckets
from slimish.weight_sync.process_group import destroy_group, new_weight_update_group

GROUP_NAME = "slimish_weight_sync"


def flatten_bucket(bucket: Bucket) -> torch.Tensor:
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for t in bucket.tensors])


class DistributedWeightSender:
    def __init__(self, *, engine_urls: list[str], engine_tp: int, master_addr: str, master_port: int, backend: str,
                 bucket_bytes: int, verify: bool = True, group_name: str = GROUP_NAME):
        self.clients = [EngineClient(url) for url in engine_urls]
        self.engine_tp, self.master_addr, self.master_port = engine_tp, master_addr, master_port
        self.backend, self.bucket_bytes, self.verify, self.group_name = backend, bucket_bytes, verify, group_name
        self.group = None
        self._pool = ThreadPoolExecutor(max(1, len(self.clients)))

    def _on_all(self, fn) -> list:
        return [f.result() for f in [self._pool.submit(fn, c) for c in self.clients]]

    def connect(self) -> None:
        world_size = 1 + len(self.clients) * self.engine_tp
        joins = [self._pool.submit(c.init_weights_update_group, master_address=self.master_addr,
                                   master_port=self.master_port, rank_offset=1 + i * self.engine_tp,
                                   world_size=world_size, group_name=self.group_name, backend=self.backend)
                 for i, c in enumerate(self.clients)]
        self.group = new_weight_update_group(backend=self.backend, master_address=self.master_addr,
                                             master_port=self.master_port, world_size=world_size, rank=0,
                                             group_name=self.group_name)
        for join in joins:
            join.result()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: str) -> dict:
        if self.group is None:
            raise RuntimeError("connect() first")
        t0 = time.monotonic()
        self._on_all(lambda c: c.begin_weight_update())
        num_buckets, num_bytes = 0, 0
        pending = None
        for bucket in plan_buckets(named_tensors, self.bucket_bytes):
            # Hold one bucket back so the last one, which flips the version, is known when it is sent.
            if pending is not None:
                num_bytes += self._send_bucket(pending, version=None)
                num_buckets += 1
            pending = bucket
        if pending is not None:
            num_bytes += self._send_bucket(pending, version=version)
            num_buckets += 1
        self._on_all(lambda c: c.end_weight_update())
        if self.verify:
            versions = self._on_all(lambda c: c.weight_version())
            if any(v != version for v in versions):
                raise RuntimeError(f"weight sync: engines report versions {versions}, expected {version}")
        return {"sync_buckets": num_buckets, "sync_mib": num_bytes / 2**20, "time_broadcast_s": time.monotonic() - t0}

    def _send_bucket(self, bucket: Bucket, *, version: str | None) -> int:
        meta = dict(names=bucket.names, dtypes=[str(t.dtype).removeprefix("torch.") for t in bucket.tensors],
                    shapes=[list(t.shape) for t in bucket.tensors], group_name=self.group_name,
                    weight_version=version, flush_cache=version is not None)
        calls = [self._pool.submit(c.update_weights_from_distributed, **meta) for c in self.clients]
        flat = flatten_bucket(bucket)
        dist.broadcast(flat, src=0, group=self.group)
        for call in calls:
            call.result()
        return flat.numel()

    def close(self) -> None:
        if self.group is not None:
            try:
                self._on_all(lambda c: c.destroy_weights_update_group(self.group_name))
            except Exception:  # engines may already be gone at shutdown
                pass
            destroy_group(self.group)
            self.group = None
        self._pool.shutdown(wait=False)
        for client in self.clients:
            client.close()
