"""Write and read a Megatron-Core distributed checkpoint (torch_dist format) one tensor chunk at a time, without
Megatron-Core or a process group.

The format is what `megatron.core.dist_checkpointing.save` writes with the torch_dist backend: a
torch.distributed.checkpoint (DCP) directory (`.metadata` + `*.distcp`), `common.pt` (the non-tensor state, empty
for a model) and `metadata.json` naming the backends. A global tensor is a DCP key with any number of chunks; DCP
asks for each chunk's data only when it writes it (`LazyTensor` below), so at most one chunk is in memory.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

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


class _ReleasePrevious:
    """torch's FileSystemWriter (2.14) keeps the last chunk written of every key alive (it collects them for its
    safetensors format even when writing torch_save), which would pin about one tensor per key. Chunks are written
    strictly one after another, so the previous chunk's memory is released when the next one is requested."""

    def __init__(self):
        self._previous: torch.Tensor | None = None

    def wrap(self, data: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def produce() -> torch.Tensor:
            if self._previous is not None:
                self._previous.untyped_storage().resize_(0)
            self._previous = data()
            return self._previous
        return produce


def save(out_dir: str | Path, *, tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[Chunk]]],
         objects: dict[str, object]) -> None:
    """Write a torch_dist checkpoint: `tensors` maps key -> (global size, dtype, chunks), `objects` maps a
    ShardedObject's unique key -> picklable value. Each chunk function must return a fresh tensor (its memory is
    released once written). Files are fsynced: the checkpoint is durable when this returns."""
    release = _ReleasePrevious()
    state: dict[str, object] = {
        key: LazyTensor(size=size, dtype=dtype, chunks=[(at, sizes, release.wrap(data)) for at, sizes, data in chunks])
        for key, (size, dtype, chunks) in tensors.items()}
    state.update(objects)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # One writer thread: chunks are produced one at a time, which bounds memory (more threads would not overlap
    # the reads, which run in the producing functions, with writes any better on one disk).
    writer = dcp.FileSystemWriter(out_dir, single_file_per_rank=True, thread_count=1, sync_files=True)
    with _single_process(), _without_record_crc32():
        dcp.save(state, storage_writer=writer, planner=dcp.DefaultSavePlanner(flatten_state_dict=False),
                 no_dist=True)
    torch.save({}, out_dir / "common.pt")
    (out_dir / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))


class DistCheckpoint:
    """Read access to a torch_dist checkpoint: global tensor shapes and dtypes, and regions of them."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        config_file = self.path / "metadata.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.path}: no metadata.json; not a Megatron distributed checkpoint")
        config = json.loads(config_file.read_text())
        if config.get("sharded_backend") != "torch_dist":
            raise ValueError(f"{self.path}: sharded_backend {config.get('sharded_backend')!r}; only torch_dist")
        self._reader = dcp.FileSystemReader(self.path)
        self._tensors = {key: md for key, md in self._reader.read_metadata().state_dict_metadata.items()
                         if hasattr(md, "chunks")}

    def meta(self, key: str) -> torch.Tensor:
        """A meta-device tensor with the global shape and stored dtype of `key`."""
        if key not in self._tensors:
            raise KeyError(f"{self.path}: no tensor {key!r} in the checkpoint")
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
