"""Write and read a Megatron-Core distributed checkpoint (torch_dist format) one tensor chunk at a time, without
Megatron-Core or a process group.

The format is what `megatron.core.dist_checkpointing.save` writes with the torch_dist backend: a
torch.distributed.checkpoint (DCP) directory (`.metadata` + `*.distcp`), `common.pt` (the non-tensor state, empty
for a model) and `metadata.json` naming the backends. A global tensor is a DCP key with any number of chunks; DCP
asks for each chunk's data only when it writes it (`LazyTensor` below); chunks are read one ahead of the write
(`_Prefetcher`), so at most two chunks are in memory; or, with several writer threads (`workers`), each thread
reads and writes its own file's chunks, two per thread at most (`_PerThreadRelease`).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import math
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from slimish.megatron_bridge.errors import CheckpointError

MEGATRON_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}

Chunk = tuple[tuple[int, ...], tuple[int, ...], Callable[[], torch.Tensor]]  # (offsets, sizes, data on demand)


class LazyTensor(torch.Tensor):
    """A global tensor of `size` seen by DCP as `chunks` whose data is produced on demand (DCP's _Checkpointable
    protocol, as DTensor implements it). Saving calls a chunk's function once, when that chunk is written; loading
    calls it to get the buffer the stored data is copied into."""

    @staticmethod
    def __new__(cls, *, size: tuple[int, ...], dtype: torch.dtype, chunks: list[Chunk]):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(size), dtype=dtype)

    def __init__(self, *, size: tuple[int, ...], dtype: torch.dtype, chunks: list[Chunk]):
        self._chunks = {tuple(offsets): (tuple(sizes), data) for offsets, sizes, data in chunks}

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape))
                for chunk, offsets in zip(self.__create_chunk_list__(), self._chunks)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                for offsets, (sizes, _) in self._chunks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._chunks[tuple(index.offset)][1]()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} only carries checkpoint chunks; {func} is not supported")


@contextlib.contextmanager
def _single_process():
    """DCP warns that it runs without torch.distributed, which is what no_dist=True asks for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def _without_record_crc32():
    """torch.save's per-record zip CRC32 costs about a third of the conversion time; torch.load (hence DCP and
    Megatron's loader) never checks it, so no reader loses anything."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


class BufferPool:
    """Reusable memory for chunks of up to `capacity` bytes. A fresh allocation that large is a fresh mapping, whose
    every page faults and is zeroed by the kernel when first written: that doubles the cost of reading a chunk from
    the page cache. `take` lends a tensor over a pooled buffer (its storage exactly the tensor's size, since
    torch.save writes whole storages), which `save` gives back once the chunk is written; larger (or empty) chunks
    get fresh memory. The pool holds at most as many buffers as chunks were lent at once (two, in `save`) and frees
    them when it is collected."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent tensor -> its buffer
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 < nbytes <= self.capacity:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            buffer = self._free.pop() if self._free else torch.empty(self.capacity, dtype=torch.uint8)
            # A ctypes view of the buffer's first nbytes; the pool keeps the buffer alive while the tensor is lent.
            tensor = torch.frombuffer((ctypes.c_char * nbytes).from_address(buffer.data_ptr()), dtype=dtype)
            self._lent[tensor.data_ptr()] = buffer
        return tensor.view(shape)

    def give_back(self, tensor: torch.Tensor) -> bool:
        """Return a tensor from `take` to the pool (False if it is not the pool's)."""
        with self._lock:
            buffer = self._lent.pop(tensor.data_ptr(), None)
            if buffer is not None:
                self._free.append(buffer)
        return buffer is not None


class _Prefetcher:
    """Produces the chunks of a save in the order DCP will request them, one ahead, on a background thread, so
    reading chunk N+1 (positioned reads, which release the GIL) overlaps writing chunk N (file writes, likewise).

    The order is the one of the final save plan (`_OrderRecordingPlanner`): FileSystemWriter with one file and one
    thread resolves the plan's tensor items in that order. A request for any other chunk is still served, by
    producing it on the spot (the prefetched one is dropped and prefetching resumes after the requested chunk), so a
    different request order costs speed, never correctness.

    Memory: torch's FileSystemWriter (2.14) keeps the last chunk written of every key alive (it collects them for its
    safetensors format even when writing torch_save), which would pin about one tensor per key. Chunks are written
    strictly one after another, so the previous chunk's memory is released (or given back to its `BufferPool`) when
    the next one is requested; with the one-ahead chunk, at most two chunks (the one being written and the next) are
    in memory, plus one being freed."""

    def __init__(self, produce: dict[tuple, Callable[[], torch.Tensor]], buffers: BufferPool | None = None):
        self._produce = produce
        self._buffers = buffers
        self._order: list[tuple] = []
        self._position: dict[tuple, int] = {}
        self._thread: ThreadPoolExecutor | None = None
        self._next: tuple[tuple, Future] | None = None
        self._previous: torch.Tensor | None = None

    def start(self, order: list[tuple]) -> None:
        """Start producing `order[0]`; later chunks follow as chunks are requested."""
        self._order = [key for key in order if key in self._produce]
        self._position = {key: i for i, key in enumerate(self._order)}
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-prefetch")
        self._schedule(0)

    def _schedule(self, position: int) -> None:
        if self._thread is not None and position < len(self._order):
            key = self._order[position]
            self._next = (key, self._thread.submit(self._produce[key]))

    def get(self, key: tuple) -> torch.Tensor:
        if self._previous is not None:
            self._release(self._previous)
            self._previous = None
        if self._next is not None and self._next[0] == key:
            tensor = self._next[1].result()
        else:  # not the chunk expected next (or no prefetching): drop the prefetched one, produce this one here
            self._drop_next()
            tensor = self._produce[key]()
        self._next = None
        self._schedule(self._position.get(key, len(self._order)) + 1)
        self._previous = tensor
        return tensor

    def _drop_next(self) -> None:
        if self._next is not None:
            future, self._next = self._next[1], None
            if not future.cancel() and future.exception() is None:
                self._release(future.result())

    def _release(self, tensor: torch.Tensor) -> None:
        if self._buffers is None or not self._buffers.give_back(tensor):
            tensor.untyped_storage().resize_(0)

    def close(self) -> None:
        self._drop_next()
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None


class _PerThreadRelease:
    """Serves chunks to several writer threads (DCP's FileSystemWriter with thread_count > 1, one file each): each
    thread asks for its file's chunks one after another, so a thread's previous chunk is written once it asks for
    the next, and is released then (or given back to its `BufferPool`). No read-ahead within a thread: the threads'
    reads and writes overlap one another. At most two chunks per thread are in memory."""

    def __init__(self, produce: dict[tuple, Callable[[], torch.Tensor]], buffers: BufferPool | None = None):
        self._produce = produce
        self._buffers = buffers
        self._local = threading.local()

    def start(self, order: list[tuple]) -> None:
        pass

    def get(self, key: tuple) -> torch.Tensor:
        previous = getattr(self._local, "previous", None)
        if previous is not None:
            if self._buffers is None or not self._buffers.give_back(previous):
                previous.untyped_storage().resize_(0)
        self._local.previous = tensor = self._produce[key]()
        return tensor

    def close(self) -> None:
        pass


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE): start writing a range of dirty pages to
    disk without waiting for it. None where libc has no such call."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, nbytes: call(fd, offset, nbytes, 2)  # 2 = SYNC_FILE_RANGE_WRITE


class _WritebackFile(io.FileIO):
    """A file that starts the disk write-back of every `WRITEBACK_BYTES` written as soon as they are written, so
    the disk writes overlap producing and writing the rest and the final fsync has little left to wait for (instead
    of all of it: the kernel's own background write-back only starts past a share of RAM, or after 30 s).
    Durability is unchanged: the writer still fsyncs the whole file before the checkpoint counts as written (a
    failed sync_file_range is ignored: it is only a hint). Trade-off: the writes themselves get slower (page
    write-back competes with them), but less so than the final fsync shrinks."""

    WRITEBACK_BYTES = 32 << 20
    _start_writeback = staticmethod(_sync_file_range() or (lambda fd, offset, nbytes: None))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._written_back = 0

    def write(self, data) -> int:
        count = super().write(data)
        end = self.tell()
        if end - self._written_back >= self.WRITEBACK_BYTES:
            self._start_writeback(self.fileno(), self._written_back, end - self._written_back)
            self._written_back = end
        return count


class _WritebackFileSystem(FileSystem):
    """DCP's local file system, writing files through `_WritebackFile`."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(_WritebackFile(path, "wb")) as stream:
            yield stream


class _OrderRecordingPlanner(dcp.DefaultSavePlanner):
    """DefaultSavePlanner that hands the final plan's order of tensor chunks to the prefetcher."""

    def __init__(self, prefetcher: _Prefetcher):
        super().__init__(flatten_state_dict=False)
        self._prefetcher = prefetcher

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        self._prefetcher.start([(item.index.fqn, tuple(item.index.offset)) for item in plan.items
                                if item.type != WriteItemType.BYTE_IO])
        return plan


def save(out_dir: str | Path, *, tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[Chunk]]],
         objects: dict[str, object], buffers: BufferPool | None = None, workers: int = 1,
         before_commit: Callable[[], None] | None = None) -> None:
    """Write a torch_dist checkpoint: `tensors` maps key -> (global size, dtype, chunks), `objects` maps a
    ShardedObject's unique key -> picklable value. Each chunk function must return a fresh tensor or one taken from
    `buffers` (its memory is released, or given back, once written) and may be called from a background thread
    (with one worker, chunks are produced one ahead of the write, see `_Prefetcher`; with `workers` > 1, that many
    threads each write a file of their own, `_PerThreadRelease`, so chunk functions must be thread-safe). Files are
    fsynced: the checkpoint is durable when this returns. `before_commit`, if given, runs once the data is written
    and before metadata.json (what makes the directory a Megatron checkpoint); if it raises, the data files are
    removed and no metadata.json is written."""
    produce = {(key, tuple(at)): data for key, (_, _, chunks) in tensors.items() for at, _, data in chunks}
    prefetcher = _Prefetcher(produce, buffers) if workers == 1 else _PerThreadRelease(produce, buffers)

    def lazy(key: str, at: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        return lambda: prefetcher.get((key, tuple(at)))

    state: dict[str, object] = {
        key: LazyTensor(size=size, dtype=dtype, chunks=[(at, sizes, lazy(key, at)) for at, sizes, _ in chunks])
        for key, (size, dtype, chunks) in tensors.items()}
    state.update(objects)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # One writer thread: one chunk is written at a time while the next is read (more writer threads would not write
    # any faster to one disk, and would multiply the chunks in memory). per_thread_copy_ahead=0 keeps DCP's serial
    # loader where CUDA is available too: its overlapping loader resolves several chunks (sorted by size) before
    # writing them, which the one-at-a-time release above does not allow.
    # With workers > 1, DCP splits the chunks by size into one file per thread and writes the files in parallel.
    writer = dcp.FileSystemWriter(out_dir, single_file_per_rank=True, thread_count=workers, sync_files=True,
                                  per_thread_copy_ahead=0)
    writer.fs = _WritebackFileSystem()
    try:
        with _single_process(), _without_record_crc32():
            dcp.save(state, storage_writer=writer, planner=_OrderRecordingPlanner(prefetcher), no_dist=True)
    finally:
        prefetcher.close()
    if before_commit is not None:
        try:
            before_commit()
        except BaseException:
            for file in [*out_dir.glob("*.distcp"), out_dir / ".metadata"]:
                file.unlink(missing_ok=True)
            raise
    torch.save({}, out_dir / "common.pt")
    (out_dir / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))


class DistCheckpoint:
    """Read access to a torch_dist checkpoint: global tensor shapes and dtypes, and regions of them."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        config_file = self.path / "metadata.json"
        if not config_file.is_file():
            raise CheckpointError(f"{self.path}: no metadata.json; not a Megatron distributed checkpoint (write one "
                                  "with `slimish convert hf-to-megatron`)")
        config = json.loads(config_file.read_text())
        if config.get("sharded_backend") != "torch_dist":
            raise CheckpointError(f"{self.path}: sharded_backend {config.get('sharded_backend')!r}; only torch_dist "
                                  "checkpoints are read")
        self._reader = dcp.FileSystemReader(self.path)
        self._tensors = {key: md for key, md in self._reader.read_metadata().state_dict_metadata.items()
                         if hasattr(md, "chunks")}

    def keys(self) -> list[str]:
        """The keys of every tensor in the checkpoint."""
        return list(self._tensors)

    def meta(self, key: str) -> torch.Tensor:
        """A meta-device tensor with the global shape and stored dtype of `key`."""
        if key not in self._tensors:
            raise CheckpointError(f"{self.path}: no tensor {key!r} in the checkpoint: it holds another model than the "
                                  "config describes; pass the config of the model that was converted")
        md = self._tensors[key]
        return torch.empty(md.size, dtype=md.properties.dtype, device="meta")

    def read(self, key: str, *, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of global tensor `key`, whatever chunks it was saved in."""
        meta = self.meta(key)
        buffer = torch.empty(sizes, dtype=meta.dtype)
        state = {key: LazyTensor(size=tuple(meta.shape), dtype=meta.dtype, chunks=[(offsets, sizes, lambda: buffer)])}
        with _single_process():
            dcp.load(state, storage_reader=self._reader, planner=dcp.DefaultLoadPlanner(flatten_state_dict=False),
                     no_dist=True)
        return buffer
