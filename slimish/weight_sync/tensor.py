"""`tensor` transport: engines on the sender's own node read each bucket straight from the sender's memory.

Per bucket the sender copies the tensors into one flat buffer that other processes can map (a CUDA allocation on
GPU, a shared-memory segment on CPU), pickles a handle to it with torch's multiprocessing reductions, and posts the
handle to every engine (`/update_weights_from_tensor`, SGLang's "flattened_bucket" layout: the buffer plus each
tensor's name, dtype, shape and byte range). The engine maps the buffer and loads the tensors from it; no byte
crosses a socket. The buffer is kept alive until every engine has answered.

CPU: the buffer must be shared with torch's `file_system` strategy (a named segment the engine opens by name).
Under the default `file_descriptor` strategy the handle is a file descriptor handed over a multiprocessing
connection whose authentication key the engine process does not have: SGLang 0.5.23's receive fails with
"AuthenticationError: digest sent was rejected" and the server goes down.

GPU: the handle is a CUDA IPC handle, which names the sender's device by its index; an engine rank under Ray sees
its GPU as device 0 whatever its index on the node. So the handle carries the device's UUID instead, which SGLang's
receiving side maps back to its own index (`sglang.srt.utils.patch_torch`, applied in every SGLang scheduler): the
sender does the same rewrite for its own pickles only (`_reduce_with_device_uuid`), where SGLang's patch would
rewrite every tensor torch pickles in the process, and fails on CPU tensors.

Overlap as in `broadcast`: the next bucket is exported and copied while the engines load the previous one, so at
most two buffers are alive. On the CPU they are reused from bucket to bucket (`FlatBuffers`), each shared once: the
engine's copy out of a buffer is done when it answers. On a GPU every bucket gets a fresh buffer, dropped once every
engine has answered: an engine answers once its copy is queued on its stream, not done, so a reused buffer could be
overwritten while it is still read. A dropped buffer is not freed while an engine holds it: torch keeps a sent CUDA
block aside until each receiver has released its handle, and a receiver synchronises its stream before it does
(`CudaIPCSentData`; the deleter in torch's StorageSharing.cpp). The fresh buffers cost nothing measurable: on one H100,
`bench/tensor_buckets.py` sent 528 MiB in 0.008 s with them and 0.009 s with reused ones (docs/benchmarks.md).
"""

from __future__ import annotations

import base64
import io
import types
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from urllib.parse import urlparse

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

from slimish.config.engine_flags import SHARD_DIRECT
from slimish.config.errors import ConfigError
from slimish.engines.client import EngineClient
from slimish.weight_sync.buckets import Bucket, FlatBuffers, ShardedBucket, views
from slimish.weight_sync.transport import Transport

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class TensorTransport(Transport):
    shards = True

    def connect(self, clients: list[EngineClient]) -> None:
        away = [c.url for c in clients if not _same_host(urlparse(c.url).hostname, self.context.master_addr)]
        if away:
            raise ConfigError("weight_sync.transport",
                              f"'tensor' needs every engine on the sending trainer rank's node "
                              f"({self.context.master_addr}); {', '.join(away)} is not: use 'broadcast' or 'disk'")
        super().connect(clients)
        self.buffers: FlatBuffers | None = None  # made at the first bucket, whose device decides reuse
        self.rank_buffers: list[FlatBuffers] | None = None  # the sharded sync's: one per engine rank

    def push(self, bucket: Bucket, *, version: str | None) -> int:
        with self.phase("flatten"):  # while the engines load the previous bucket
            if self.buffers is None:  # reused on the CPU, fresh per bucket on a device (see the module docstring)
                self.buffers = FlatBuffers(share=share_by_name, reuse=bucket.tensors[0].device.type == "cpu")
            flat, metadata = self.buffers.flatten(bucket), flattened_metadata(bucket)
            # One pickle per receiving rank: under the file_system strategy each pickle takes a reference to the
            # shared segment and each unpickling drops one, so a pickle read by two ranks would drop the sender's
            # own reference too, and the segment's name would be gone when the next bucket reuses the buffer.
            payloads = {c.url: [serialize({"flattened_tensor": _crossing(flat), "metadata": metadata})
                                for _ in range(self.context.engine_tp)] for c in self.clients}
        self.wait_loaded()
        calls = self.on_all(lambda c: c.update_weights_from_tensor(
            serialized=payloads[c.url], load_format="flattened_bucket", weight_version=version,
            flush_cache=version is not None))
        # The buffer lives until the engines have read it. In flight from here: each engine maps and copies it
        # while its call is open.
        self.loading(calls, keep=flat, deadline=self.deadline(flat.numel()))
        if version is not None:
            self.wait_loaded()
        return flat.numel()

    def push_shards(self, bucket: ShardedBucket, *, version: str | None) -> int:
        """Each engine rank r maps only its own part: `serialized_named_tensors[r]` (SGLang hands rank r that entry)
        is a list of (engine parameter, view of rank r's flat buffer), loaded with `load_format="direct"` (each
        tensor copied into the parameter of its name, shape checked). One shared segment per rank per bucket."""
        with self.phase("flatten"):
            if self.rank_buffers is None:
                from slimish.weight_sync.owners import rank_buffers

                self.rank_buffers = rank_buffers(bucket)
            placed, staged = stage_shards(bucket, self.rank_buffers, len(self.clients))
            payloads = {c.url: pickles for c, pickles in zip(self.clients, staged)}
        self.wait_loaded()
        # SGLang's stock copy by name, or slimish's (the same, then the model's post-processing: MLA).
        load_format = "direct" if self.direct_load else SHARD_DIRECT
        calls = self.on_all(lambda c: c.update_weights_from_tensor(
            serialized=payloads[c.url], load_format=load_format, weight_version=version,
            flush_cache=version is not None))
        self.loading(calls, keep=placed, deadline=self.deadline(max(bucket.rank_bytes)))
        if version is not None:
            self.wait_loaded()
        return bucket.nbytes

    def push_owned(self, shards: list[list[str]], *, rank_bytes: list[int], go: Callable[[], None],
                   wire: Callable[[], None] | None = None) -> None:
        """Post a bucket an expert owner staged in its own shared segments (`shards[e][r]`: engine e's rank r's
        pickle, `stage_shards`) and, once every engine has loaded it, call `go` (the owner may reuse its segments).
        Loaded with slimish's `load_by_name` (expert slots)."""
        self.wait_loaded()
        payloads = {c.url: pickles for c, pickles in zip(self.clients, shards)}
        calls = self.on_all(lambda c: c.update_weights_from_tensor(
            serialized=payloads[c.url], load_format=SHARD_DIRECT, weight_version=None, flush_cache=False))
        self.loading(calls, deadline=self.deadline(max(rank_bytes)))
        self.wait_loaded()
        go()

    def abort(self) -> None:
        self.let_go()


def stage_shards(bucket: ShardedBucket, rank_buffers: list[FlatBuffers],
                 engines: int) -> tuple[list, list[list[str]]]:
    """Copy each engine rank's part of `bucket` into its buffer of `rank_buffers` (one shared segment per rank):
    (what must stay alive until the engines have loaded it, per engine the per-rank pickles of (engine parameter,
    view of rank r's buffer) lists: `serialized_named_tensors`, SGLang handing rank r entry r). One pickle per
    receiving rank of every engine: under the file_system strategy each pickle takes a reference to the shared
    segment and each unpickling drops one, so a pickle read twice would drop the sender's own reference too."""
    placed = [buffers.place(part) for buffers, part in zip(rank_buffers, bucket.ranks)]
    named = [list(zip(part.names, views(_crossing(flat), part, offsets)))
             for part, (flat, offsets) in zip(bucket.ranks, placed)]
    return placed, [[serialize(pairs) for pairs in named] for _ in range(engines)]


def _same_host(engine_host: str | None, sender_host: str) -> bool:
    return engine_host == sender_host or (engine_host in LOOPBACK and sender_host in LOOPBACK)


def share_by_name(buffer: torch.Tensor) -> None:
    """Make a new buffer mappable by the engines: a CPU buffer (or the emulated GPU's CPU data) into shared memory;
    a CUDA buffer already is (its IPC handle is made when it is pickled)."""
    host = getattr(buffer, "cpu_data", buffer)
    if host.device.type == "cpu":
        with _file_system_sharing():
            host.share_memory_()


def _crossing(flat: torch.Tensor) -> torch.Tensor:
    """What the handle is made of: the buffer, or on the emulated GPU (`slimish.compat.emulated_gpu`) its CPU data,
    shared by name: the stand-in for CUDA IPC, the one boundary the emulated GPU cannot cross (the engine maps CPU
    memory)."""
    return getattr(flat, "cpu_data", flat)


def flattened_metadata(bucket: Bucket) -> list[types.SimpleNamespace]:
    """SGLang's metadata for each tensor of the flattened bucket: name, shape, dtype and byte range.
    (SimpleNamespace: SGLang's unpickler admits it, and it carries the fields SGLang reads.)"""
    metadata, offset = [], 0
    for name, tensor in zip(bucket.names, bucket.tensors):
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                              start_idx=offset, end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    return metadata


def serialize(obj) -> str:
    """What SGLang's MultiprocessingSerializer makes: a ForkingPickler pickle (tensors by handle, CUDA devices by
    UUID), base64."""
    buffer = io.BytesIO()
    with _file_system_sharing():
        pickler = ForkingPickler(buffer)
        pickler.dispatch_table[torch.Tensor] = _reduce_with_device_uuid
        pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


def _reduce_with_device_uuid(tensor: torch.Tensor):
    """torch's reduction of `tensor` for another process; for a CUDA tensor, with its device's UUID in place of the
    device index, at the argument SGLang's receiving side maps back (`patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX`,
    whose `_device_to_uuid` this uses: the two ends agree by construction)."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        from sglang.srt.utils.patch_torch import _REDUCE_TENSOR_ARG_DEVICE_INDEX as at
        from sglang.srt.utils.patch_torch import _device_to_uuid

        args = (*args[:at], _device_to_uuid(args[at]), *args[at + 1:])
    return rebuild, args


@contextmanager
def _file_system_sharing():
    """torch's sharing strategy is process-wide: switch it only around our own sharing."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
