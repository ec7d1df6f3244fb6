"""`disk` transport: the sender streams each bucket to a safetensors shard in a fresh directory under
`weight_sync.disk_dir` (one bucket in memory at a time); with the last bucket every engine loads the directory
(`/update_weights_from_disk`, which loads whatever tensors it finds there) and takes the new version, and the
directory is removed. For engines that share no network group with the trainer, only a filesystem, and as the path
that needs nothing but the engine's HTTP port.

Sharded (`weight_sync.sharded`): each bucket is one safetensors file per engine rank, holding only that rank's
engine parameters (`slimish.weight_sync.sharding.EngineShards`), and each rank reads only its own: with the last
bucket every engine is asked once, as on the full path (`/update_weights_from_tensor`, inside /begin_weight_update
... /end_weight_update), to load with slimish's engine-side loader (`slimish.weight_sync.engine_loader`, registered
by --custom-weight-loader), rank r's payload naming rank r's files; then the directory is removed."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from slimish import run_layout
from slimish.config.engine_flags import SHARD_LOADER
from slimish.engines.client import EngineClient
from slimish.weight_sync.buckets import Bucket, ShardedBucket
from slimish.weight_sync.tensor import serialize
from slimish.weight_sync.transport import Transport


class DiskTransport(Transport):
    shards = True
    shard_loader = SHARD_LOADER

    @property
    def bracketed(self) -> bool:
        """The full path's /update_weights_from_disk is a whole update of its own; the sharded path's loads are
        /update_weights_from_tensor requests, which SGLang takes only inside an update session."""
        return self.sharded

    def connect(self, clients: list[EngineClient]) -> None:
        super().connect(clients)
        self._dir: Path | None = None
        self._shards = 0
        self._owned_dirs: list[str] = []  # the expert owners' directories of this sync (slimish.weight_sync.owners)
        Path(self.context.disk_dir).mkdir(parents=True, exist_ok=True)

    def push(self, bucket: Bucket, *, version: str | None) -> int:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix=run_layout.SYNC_PREFIX, dir=self.context.disk_dir))
        self._shards += 1
        with self.phase("write"):
            save_file(owning_tensors(bucket), str(self._dir / f"model-{self._shards:05d}.safetensors"))
        if version is not None:
            path = str(self._dir)
            # In flight: every engine reads every shard, the whole model, within one call.
            total = sum(f.stat().st_size for f in self._dir.iterdir())
            self.loading(self.on_all(lambda c: c.update_weights_from_disk(model_path=path, weight_version=version)),
                         deadline=self.deadline(total))
            self.wait_loaded()
            self._remove_shards()  # loaded: this sync's shards are done with
        return bucket.nbytes

    def _sharded_dir(self, ranks: int) -> None:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix=run_layout.SYNC_PREFIX, dir=self.context.disk_dir))
            self._rank_files: list[list[Path]] = [[] for _ in range(ranks)]

    def push_owned(self, shards: dict, *, rank_bytes: list[int], go, wire=None) -> None:
        """An expert owner wrote a bucket's per-rank files itself (`shards`: {"dir", "files": per engine rank
        [(path, bytes)]}): they join the one load of the last bucket, and its directory is removed with this
        sync's. `go` at once: the owner's files stay until then."""
        self._sharded_dir(len(shards["files"]))
        self._owned_dirs.append(shards["dir"])
        for rank, files in enumerate(shards["files"]):
            self._rank_files[rank] += [Path(path) for path, _ in files]
        go()

    def push_shards(self, bucket: ShardedBucket, *, version: str | None) -> int:
        self._sharded_dir(len(bucket.ranks))
        self._shards += 1
        with self.phase("write"):
            for rank, part in enumerate(bucket.ranks):
                if part.names:
                    path = self._dir / f"rank{rank:03d}-{self._shards:05d}.safetensors"
                    save_file(owning_tensors(part), str(path))
                    self._rank_files[rank].append(path)
        if version is not None:
            # One load of the whole model, as on the full path: rank r reads only its own files. One pickle per
            # receiving rank (each takes a reference to the shared size tensors, as in the tensor transport).
            payloads = {c.url: [serialize([(str(f), torch.tensor([f.stat().st_size], device="cpu")) for f in files])
                                for files in self._rank_files] for c in self.clients}
            calls = self.on_all(lambda c: c.update_weights_from_tensor(
                serialized=payloads[c.url], load_format=SHARD_LOADER, weight_version=version, flush_cache=True))
            self.loading(calls, deadline=self.deadline(max(sum(f.stat().st_size for f in files)
                                                           for files in self._rank_files)))
            self.wait_loaded()
            self._remove_shards()
        return bucket.nbytes

    def _remove_shards(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            for owned in self._owned_dirs:
                shutil.rmtree(owned, ignore_errors=True)
            self._dir, self._shards, self._owned_dirs = None, 0, []

    def abort(self) -> None:
        # The shards stay until `close`: an engine still loading them when the sync was given up (a slow one, or a
        # frozen one continued) must find them. SGLang 0.5.23 takes a missing directory for a Hugging Face repo id,
        # and its scheduler dies of the error (seen here).
        self.let_go()

    def close(self) -> None:
        self._remove_shards()
        super().close()


def owning_tensors(bucket: Bucket) -> dict[str, torch.Tensor]:
    """The bucket's tensors as safetensors wants them, each contiguous and owning its storage: a view into a larger
    tensor (an HF tensor's slice, a shard's column block) is copied, a tensor that already is so (a fused engine
    parameter, built fresh) is not."""
    def owning(t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.storage_offset() == 0 and \
            t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return {name: t.detach() if owning(t) else t.detach().clone(memory_format=torch.contiguous_format)
            for name, t in zip(bucket.names, bucket.tensors)}
