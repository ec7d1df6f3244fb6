"""Streaming access to Hugging Face safetensors checkpoints: read one tensor at a time, write shards tensor by tensor.

Reads parse the safetensors headers and copy each tensor's bytes with a positioned read into a fresh tensor.
Nothing stays mapped, so resident memory is one tensor however large the checkpoint (pages of a memory-mapped file
count as resident for as long as the mapping lives). A missing, truncated or corrupt shard raises `CheckpointError`
naming the file.

A block-scaled FP8 checkpoint (config.json's `quantization_config`, see `fp8`) reads as bf16: each `X.weight` with a
`X.weight_scale_inv` is dequantized as it is read (whole or by rows), and the scale tensors are not listed.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from slimish.megatron_bridge import fp8
from slimish.megatron_bridge.errors import CheckpointError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
INDEX = "model.safetensors.index.json"
_MAX_READ = 1 << 30  # Linux transfers at most ~2 GiB per read() call


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def _read_header(file: Path) -> dict[str, _Entry]:
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= size - 8:
                raise ValueError(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read safetensors shard {file}: {exc}; the file is incomplete or corrupt: copy "
                              "or export it again") from None
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        if 8 + length + end > size:
            raise CheckpointError(f"safetensors shard {file} is truncated ({size} bytes; {name!r} ends at "
                                  f"{8 + length + end}): copy or export it again")
        entries[name] = _Entry(file, _DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + length + begin, end - begin)
    return entries


class HFCheckpoint:
    """Name -> tensor access over `model.safetensors` or an indexed set of shards."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX
        single = self.path / "model.safetensors"
        if index.is_file():
            files = sorted({self.path / f for f in json.loads(index.read_text())["weight_map"].values()})
        elif single.is_file():
            files = [single]
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or {INDEX}")
        self._entries: dict[str, _Entry] = {}
        self.bytes_read = 0  # tensor bytes asked of the files by `get` so far (headers not counted)
        for file in files:
            self._entries.update(_read_header(file))
        # weight name -> its FP8 block scales
        self._scales = {name[:-len(fp8.SCALE_SUFFIX)]: self._entries.pop(name) for name in list(self._entries)
                        if name.endswith(fp8.SCALE_SUFFIX)}
        self._block = fp8.block_size(_config(self.path)) if self._scales else None
        if self._scales and self._block is None:
            raise CheckpointError(f"{self.path}: holds FP8 block scales ({next(iter(self._scales))}"
                                  f"{fp8.SCALE_SUFFIX}) but config.json has no quantization_config; restore the "
                                  "model's config.json")

    def names(self) -> list[str]:
        return list(self._entries)

    def quantized(self, name: str) -> bool:
        """Whether `name` is stored in FP8 (and read as bf16)."""
        return name in self._scales

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype `get` returns: bf16 for an FP8 weight."""
        return fp8.DTYPE if name in self._scales else self._entry(name).dtype

    def nbytes(self, name: str) -> int:
        """The bytes of the tensor `get` returns."""
        entry = self._entry(name)
        return math.prod(entry.shape) * fp8.DTYPE.itemsize if name in self._scales else entry.nbytes

    def get(self, name: str, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """The stored tensor, or its rows [start, stop) along dim 0 and / or its columns [start, stop) along dim 1,
        read into `out` (contiguous, matching shape and dtype) or a fresh tensor. Only those bytes are read: rows are
        one contiguous range; columns are one positioned read per row (a strided read: the row's other columns are
        never read, at the cost of a system call per row). An FP8 weight is dequantized to bf16 (only its rows'
        blocks of scales read; a column slice of it is cut from its dequantized rows). `bytes_read` counts every
        byte asked of the files."""
        entry = self._entry(name)
        if name in self._scales:
            return self._dequantized(name, entry, rows=rows, cols=cols, out=out)
        shape, ranges = _ranges(name, entry, rows, cols)
        if out is None:
            out = torch.empty(shape, dtype=entry.dtype, device="cpu")
        elif tuple(out.shape) != shape or out.dtype != entry.dtype or not out.is_contiguous():
            raise ValueError(f"{name}: out is {tuple(out.shape)} {out.dtype}, reading {shape} {entry.dtype}")
        return self._read_into(name, entry, out, ranges)

    def _read_into(self, name: str, entry: _Entry, out: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The file's byte `ranges` of `entry`, concatenated, into `out`'s memory."""
        nbytes = sum(size for _, size in ranges)
        # A ctypes view of the tensor's memory: unlike .numpy(), it leaves the storage resizable (releasable).
        view = memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B") if nbytes else b""
        try:
            with open(entry.file, "rb", buffering=0) as f:
                at = 0
                for file_offset, size in ranges:
                    _pread_into(f.fileno(), view[at:at + size], file_offset)
                    at += size
        except OSError as exc:
            raise CheckpointError(f"cannot read tensor {name!r} from shard {entry.file}: {exc}") from None
        self.bytes_read += nbytes
        return out

    def _dequantized(self, name: str, entry: _Entry, *, rows, cols, out) -> torch.Tensor:
        scale = self._scales[name]
        expected = tuple(math.ceil(n / b) for n, b in zip(entry.shape, self._block))
        if len(entry.shape) != 2 or scale.shape != expected:
            raise CheckpointError(f"{entry.file}: {name}{fp8.SCALE_SUFFIX} is {scale.shape}, expected {expected} for "
                                  f"{name} {entry.shape} in {self._block} blocks; the checkpoint does not match its "
                                  "config.json's weight_block_size")
        shape, ranges = _ranges(name, entry, rows, None)
        want = shape if cols is None else (shape[0], cols[1] - cols[0])
        if out is not None and (tuple(out.shape) != want or out.dtype != fp8.DTYPE or not out.is_contiguous()):
            raise ValueError(f"{name}: out is {tuple(out.shape)} {out.dtype}, reading {want} {fp8.DTYPE}")
        stored = self._read_into(name, entry, torch.empty(shape, dtype=entry.dtype, device="cpu"), ranges)
        first = rows[0] if rows is not None else 0
        scale_shape, scale_ranges = _ranges(name + fp8.SCALE_SUFFIX, scale,
                                            fp8.scale_rows((first, first + shape[0]), self._block[0]), None)
        scales = self._read_into(name + fp8.SCALE_SUFFIX, scale,
                                 torch.empty(scale_shape, dtype=scale.dtype, device="cpu"), scale_ranges)
        if cols is None:
            return fp8.dequantize(stored, scales, self._block, first_row=first, out=out)
        whole_rows = fp8.dequantize(stored, scales, self._block, first_row=first)
        if not 0 <= cols[0] <= cols[1] <= shape[1]:
            raise ValueError(f"{name}: columns {cols} outside shape {entry.shape}")
        part = whole_rows[:, cols[0]:cols[1]]
        return part.contiguous() if out is None else out.copy_(part)


def _ranges(name: str, entry: _Entry, rows: tuple[int, int] | None,
            cols: tuple[int, int] | None) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """(shape, [(file offset, bytes)]) of rows [start, stop) and / or columns [start, stop) of `entry`, or of all
    of it: one range for rows, one per row for columns."""
    shape, offset = entry.shape, entry.offset
    if rows is None and cols is None:
        return shape, [(offset, entry.nbytes)]
    row_bytes = entry.nbytes // shape[0] if shape and shape[0] else 0
    start, stop = rows if rows is not None else (0, shape[0] if shape else 0)
    if shape and not 0 <= start <= stop <= shape[0]:
        raise ValueError(f"{name}: rows {rows} outside {shape[0]}")
    if cols is None:
        return (stop - start, *shape[1:]), [(offset + start * row_bytes, (stop - start) * row_bytes)]
    if len(shape) < 2 or not 0 <= cols[0] <= cols[1] <= shape[1]:
        raise ValueError(f"{name}: columns {cols} outside shape {shape}")
    col_bytes = row_bytes // shape[1] if shape[1] else 0
    width = (cols[1] - cols[0]) * col_bytes
    return ((stop - start, cols[1] - cols[0], *shape[2:]),
            [(offset + row * row_bytes + cols[0] * col_bytes, width) for row in range(start, stop)])


def _config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` with the file's bytes from `offset` on (several reads where one would exceed `_MAX_READ`)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + _MAX_READ]], offset + done)
        if got == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += got


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_hf_shards(out_dir: str | Path, specs: list[tuple[str, torch.Tensor]],
                    tensors: Iterable[tuple[str, torch.Tensor]], *, max_shard_bytes: int) -> list[Path]:
    """Write `tensors` as safetensors shards of at most `max_shard_bytes` (a larger tensor gets its own shard), plus
    the index when there is more than one shard. `specs` lists (name, meta tensor) in the order `tensors` yields
    them: headers come first in the file, so every shape is fixed before any data is read.
    """
    out_dir = Path(out_dir)
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, meta in specs:
        nbytes = meta.numel() * meta.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, meta))
        size += nbytes
    files = [out_dir / name for name in _shard_names(len(groups))]
    stream = iter(tensors)
    for file, group in zip(files, groups):
        _write_shard(file, group, stream)
    if next(stream, None) is not None:
        raise CheckpointError("more tensors than specs")
    if len(files) > 1:
        weight_map = {name: file.name for file, group in zip(files, groups) for name, _ in group}
        total = sum(meta.numel() * meta.element_size() for _, meta in specs)
        (out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")
    return files


def _write_shard(file: Path, group: list[tuple[str, torch.Tensor]], stream) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, meta in group:
        nbytes = meta.numel() * meta.element_size()
        header[name] = {"dtype": _NAMES[meta.dtype], "shape": list(meta.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name, meta in group:
            got_name, tensor = next(stream)
            if got_name != name or tensor.shape != meta.shape or tensor.dtype != meta.dtype:
                raise CheckpointError(f"{file}: expected {name} {tuple(meta.shape)} {meta.dtype}, got {got_name} "
                                      f"{tuple(tensor.shape)} {tensor.dtype}")
            f.write(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))
