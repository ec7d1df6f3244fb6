"""`broadcast` transport: a torch.distributed group between the sending trainer rank and every engine rank (gloo on
CPU, NCCL on GPU: only the backend string differs). Per bucket every engine is told the bucket's names, dtypes and
shapes over HTTP (`/update_weights_from_distributed`, SGLang's "flattened_bucket" layout) while the sender
broadcasts one flat uint8 tensor: the tensors' bytes concatenated in order.

Overlap: `push` returns once its bucket is on the wire, without waiting for the engines to load it; the next
bucket is exported and flattened meanwhile, and the next `push` waits for the engines' answers before it sends. So
at most two buckets are alive on the sender (the one being loaded has already left it), flattened into two reused
buffers (`FlatBuffers`), and the last bucket, which flips the version, is waited for before `push` returns."""

from __future__ import annotations

import logging
from collections.abc import Callable

from slimish import collectives
from slimish.engines.client import EngineClient, EngineError
from slimish.weight_sync.buckets import Bucket, FlatBuffers
from slimish.weight_sync.process_group import destroy_group, new_weight_update_group
from slimish.weight_sync.transport import Transport, tensor_meta

logger = logging.getLogger(__name__)


class BroadcastTransport(Transport):
    def connect(self, clients: list[EngineClient]) -> None:
        super().connect(clients)
        ctx = self.context
        self.group, self._joined = None, False
        self.buffers = FlatBuffers()
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
        self.loading(self.on_all(lambda c: c.update_weights_from_distributed(**meta)))
        with self.phase("wire"):
            collectives.broadcast(flat, src=0, group=self.group)
        if version is not None:
            self.wait_loaded()
        return flat.numel()

    def push_remote(self, meta: dict, *, group_name: str, go: Callable[[], None]) -> None:
        """Ask every engine for a bucket that another rank broadcasts on its own group `group_name` (a pipeline
        stage's sender, `slimish.weight_sync.stages`), then `go()` tells that rank to send it. Ordered and
        overlapped like `push`: the engines' answers are awaited before the next bucket is asked for."""
        self.wait_loaded()
        request = dict(**meta, group_name=group_name, weight_version=None, flush_cache=False)
        self.loading(self.on_all(lambda c: c.update_weights_from_distributed(**request)))
        go()

    def abort(self) -> None:
        # Closing the sender's side of the group makes an engine blocked receiving a bucket fail that receive (its
        # /update_weights_from_distributed answers success=false) instead of waiting out the group's timeout.
        if self.group is not None:
            destroy_group(self.group)
            self.group = None
        self.let_go()

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
        super().close()
