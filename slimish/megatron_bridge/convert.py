"""Offline conversion between an HF safetensors checkpoint and a Megatron-Core distributed checkpoint (torch_dist).

    hf_to_megatron(hf_dir=..., out_dir=..., tensor_parallel=1, pipeline_parallel=1, expert_parallel=1)
    megatron_to_hf(megatron_dir=..., hf_config_dir=..., out_dir=...)
    dequantize_hf(hf_dir=..., out_dir=...)   block-scaled FP8 HF -> bf16 HF

Both walk the bridge's rule table (`dense.model_rules`), the one the trainer loads and weight sync exports with,
and stream: one (fused) tensor is in memory at a time, so memory stays flat as the model grows. The distributed
checkpoint holds full (unsharded) tensors keyed as Megatron-Core's GPTModel names them, so the trainer loads it at
any TP/PP/EP layout. The parallel sizes given check that the model splits evenly at that layout, and the
tensor-parallel size also cuts each split tensor's chunks at that layout's slices (`tensor_parallel_dim`): torch's
DCP reads every stored chunk a rank's slice overlaps whole, so a job at that TP (or a divisor of it) reads only its
slices, where chunks cut at TP1 make each rank read the whole of every row-parallel tensor.
Dtypes are kept as stored: HF -> Megatron -> HF is bit-exact (multi-token-prediction layers are not converted,
see `dense.is_mtp_tensor`), except that a block-scaled FP8 checkpoint (DeepSeek-V3's release, see `fp8`) is
dequantized to bf16 as it is read, and its config.json is written back without `quantization_config`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from slimish.errors import UserError
from slimish.megatron_bridge import dense, dist_ckpt_io, mla, slice_read
from slimish.megatron_bridge.errors import CheckpointError, MappingError
from slimish.megatron_bridge.hf_config import Architecture, architecture_from_hf, read_hf_config
from slimish.megatron_bridge.hf_io import INDEX, HFCheckpoint, write_hf_shards
from slimish.megatron_bridge.hf_shapes import KNOWN_FAMILIES, check_shapes, expected_hf_shapes


class LayoutError(UserError, ValueError):
    """The model does not split evenly at the requested parallel layout."""


def check_layout(arch: Architecture, *, tensor_parallel: int, pipeline_parallel: int,
                 expert_parallel: int = 1) -> None:
    splits = [("num_attention_heads", arch.num_attention_heads, tensor_parallel),
              ("num_key_value_heads", arch.num_query_groups, tensor_parallel),
              ("intermediate_size", arch.ffn_hidden_size, tensor_parallel),
              ("vocab_size", arch.vocab_size, tensor_parallel),
              ("num_hidden_layers", arch.num_layers, pipeline_parallel)]
    if arch.moe is None and expert_parallel != 1:
        raise LayoutError(f"expert parallelism ({expert_parallel}) needs a mixture-of-experts model")
    if arch.moe is not None:
        splits.append(("num_experts", arch.moe.num_experts, expert_parallel))
        splits.append(("moe_intermediate_size", arch.moe.ffn_hidden_size, tensor_parallel))
        if arch.moe.shared_ffn_hidden_size:
            splits.append(("moe_intermediate_size * n_shared_experts", arch.moe.shared_ffn_hidden_size,
                           tensor_parallel))
    if arch.mla is not None:
        splits += [(what, value, tensor_parallel) for what, value in mla.tp_splits(arch)]
    for what, value, parts in splits:
        if parts < 1 or value % parts:
            raise LayoutError(f"config.json {what}={value} does not split over {parts} ranks; choose a parallel size "
                              "that divides it")


def _read_rows(rule: dense.Rule, ckpt: HFCheckpoint, *, shape: tuple[int, ...], rows: tuple[int, int],
               buffers: dist_ckpt_io.BufferPool | None = None):
    """Rows [start, stop) of the Megatron tensor of a rule that stacks its HF tensors in order, read straight from
    the files into one buffer (taken from `buffers` if given)."""
    start, stop = rows
    block, dtype = (stop - start, *shape[1:]), ckpt.dtype(rule.hf[0])
    out = buffers.take(block, dtype) if buffers is not None else torch.empty(block, dtype=dtype)
    base = 0
    for name in rule.hf:
        count = ckpt.shape(name)[0]
        lo, hi = max(start, base), min(stop, base + count)
        if lo < hi:
            ckpt.get(name, rows=(lo - base, hi - base), out=out[lo - start:hi - start])
        base += count
    return out


def _row_blocks(shape: tuple[int, ...], itemsize: int, chunk_bytes: int, parts: int = 1) -> list[tuple[int, int]]:
    """Row ranges of at most `chunk_bytes` each that never cross a boundary between `parts` equal parts of the rows
    (`shape[0]` divisible by `parts`)."""
    row_bytes = max(1, itemsize * math.prod(shape[1:]))
    step = max(1, chunk_bytes // row_bytes)
    part = shape[0] // parts if shape[0] else 0
    return [(start, min(start + step, base + part)) for base in range(0, shape[0], part or 1)
            for start in range(base, base + part, step)] or [(0, 0)]


# The converter has no Megatron model to read `partition_dim` from: these are the names Megatron's layer specs give
# their tensor-parallel linears (tests/megatron_bridge/test_slice_read.py checks them against the built models'
# attributes). Row-parallel linears split their columns; column-parallel ones, the embedding and the output layer
# their rows (MLA's down projections too in the local spec; the TE spec keeps them whole, where the cut costs
# nothing).
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
_COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
                    "output_layer.weight", "linear_q_proj.weight", "linear_q_down_proj.weight",
                    "linear_q_up_proj.weight", "linear_kv_down_proj.weight", "linear_kv_up_proj.weight")


def tensor_parallel_dim(megatron_name: str) -> int | None:
    """The dimension Megatron's tensor parallelism splits the parameter `megatron_name` along (None: whole on every
    rank: norms, routers, biases of row-parallel linears)."""
    if megatron_name.endswith(_ROW_PARALLEL):
        return 1
    if megatron_name.endswith(_COLUMN_PARALLEL):
        return 0
    return None


def _chunks(rule: dense.Rule, full: tuple[int, ...], dtype: torch.dtype, ckpt: HFCheckpoint, arch: Architecture,
            *, tensor_parallel: int, chunk_bytes: int, buffers: dist_ckpt_io.BufferPool):
    """(offsets, sizes, read) of each chunk the rule's Megatron tensor of shape `full` is stored in: cut at the
    tensor-parallel slices of `tensor_parallel` (`tensor_parallel_dim`; gate/up: each half's), and tensors that are
    plain copies or gate/up stacks further into row blocks of at most `chunk_bytes`; `read()` reads one chunk's
    data (only its bytes)."""
    dim = tensor_parallel_dim(rule.megatron) if tensor_parallel > 1 and full else None
    if dim is not None and not slice_read.splits_evenly(rule, dim, ckpt, arch, tensor_parallel):
        dim = None
    if dim == 1:  # row-parallel: column blocks, each in row blocks
        width = full[1] // tensor_parallel
        for part in range(tensor_parallel):
            cols = (part * width, (part + 1) * width)
            for rows in _row_blocks((full[0], width, *full[2:]), dtype.itemsize, chunk_bytes):
                yield ((rows[0], cols[0]), (rows[1] - rows[0], width),
                       functools.partial(_read_block, rule, ckpt, rows, cols, buffers))
        return
    if dense.stacks_in_order(rule) and full:
        parts = tensor_parallel * len(rule.hf) if dim == 0 else 1
        for rows in _row_blocks(full, dtype.itemsize, chunk_bytes, parts):
            yield ((rows[0], *[0] * (len(full) - 1)), (rows[1] - rows[0], *full[1:]),
                   functools.partial(_read_rows, rule, ckpt, shape=full, rows=rows, buffers=buffers))
        return
    if dim == 0:  # fused q/k/v, MLA's rotary rows: each tensor-parallel part assembled from its own rows
        rows = full[0] // tensor_parallel
        for part in range(tensor_parallel):
            yield ((part * rows, *[0] * (len(full) - 1)), (rows, *full[1:]),
                   functools.partial(slice_read.read_part, rule, 0, ckpt, arch, part, tensor_parallel))
        return
    yield ((0,) * len(full), tuple(full),
           lambda: dense.to_megatron(rule, [ckpt.get(name) for name in rule.hf], arch))


def _read_block(rule: dense.Rule, ckpt: HFCheckpoint, rows: tuple[int, int], cols: tuple[int, int],
                buffers: dist_ckpt_io.BufferPool) -> torch.Tensor:
    """Rows `rows` x columns `cols` of a plain copy's tensor, read into a buffer of `buffers`."""
    (name,) = rule.hf
    out = buffers.take((rows[1] - rows[0], cols[1] - cols[0]), ckpt.dtype(name))
    return ckpt.get(name, rows=rows, cols=cols, out=out)


def default_workers() -> int:
    """Writer threads when not told: the cores this process may use, at most 8 (more do not write one disk
    faster, and each holds up to two chunks)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


# From this size on, transformers' shapes for the config (seconds: importing transformers, building the model on
# the meta device), when asked for or needed (a family `hf_shapes` does not know), are worked out in a process of
# their own while the conversion runs, and checked before the checkpoint is committed; below it, first (a spawned
# process costs more than it saves on a small model). The known families' shapes take microseconds: checked first.
BACKGROUND_SHAPE_CHECK_BYTES = 1 << 30


_SHAPES_CHILD = ("import json, sys; from slimish.megatron_bridge.hf_shapes import transformers_hf_shapes; "
                 "json.dump(transformers_hf_shapes(json.loads(sys.argv[1])), sys.stdout)")


def _shape_check(config: dict, found: dict[str, tuple[int, ...]], *, source: str, transformers: bool,
                 background: bool):
    """A function that raises `CheckpointError` if `found` does not fit `config`: checked now (from config.json
    alone for a known family, see `hf_shapes.expected_hf_shapes`), or, when transformers' model is the reference and
    `background` is set, in a child Python started now (its own core) and waited for when the function is called."""
    where = f"{source}/config.json"
    uses_transformers = transformers or config.get("model_type") not in KNOWN_FAMILIES
    if not (background and uses_transformers):
        check_shapes(found, expected_hf_shapes(config, transformers=transformers), source=source, config=where)
        return lambda: None
    child = subprocess.Popen([sys.executable, "-c", _SHAPES_CHILD, json.dumps(config)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish() -> None:
        out, err = child.communicate()  # both pipes at once: transformers may warn more than a pipe holds
        if child.returncode:
            why = err.strip().splitlines()[-1] if err.strip() else f"exit code {child.returncode}"
            raise CheckpointError(f"{where}: transformers could not build the model it describes to check the "
                                  f"weights' shapes: {why}")
        expected = {name: tuple(shape) for name, shape in json.loads(out).items()}
        check_shapes(found, expected, source=source, config=where)
    return finish


def hf_to_megatron(*, hf_dir: str | Path, out_dir: str | Path, tensor_parallel: int = 1,
                   pipeline_parallel: int = 1, expert_parallel: int = 1, chunk_bytes: int = 64 << 20,
                   workers: int | None = None, progress: bool = True, transformers_shape_check: bool = False) -> Path:
    """Write the HF checkpoint in `hf_dir` as a Megatron-Core torch_dist checkpoint in `out_dir`.

    Tensors that are plain copies or gate/up stacks are written in row blocks of at most `chunk_bytes`, so memory
    does not grow with the largest tensor either (fused q/k/v, interleaved per group, is converted whole, or one
    tensor-parallel part at a time). Split tensors are cut at `tensor_parallel`'s slices (`_chunks`), so a job at
    that tensor-parallel size reads only its slices.
    `workers` threads (default `default_workers()`) each read, convert and write their own share of the chunks to a
    file of their own: memory is at most two chunks per worker. A checkpoint whose shapes do not fit config.json is
    refused, and nothing that Megatron would load is left in `out_dir`; the shapes config.json implies are worked
    out from it alone for the known families, or by transformers with `transformers_shape_check`."""
    config = read_hf_config(hf_dir)
    arch = architecture_from_hf(config)
    check_layout(arch, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                 expert_parallel=expert_parallel)
    workers = workers or default_workers()
    ckpt = HFCheckpoint(hf_dir)
    rules = dense.model_rules(arch)
    total = sum(ckpt.nbytes(n) for r in rules for n in r.hf)
    unmapped = dense.unmapped_hf_names(ckpt.names(), arch)
    if unmapped:
        raise MappingError(f"{hf_dir}: {len(unmapped)} tensors have no Megatron mapping under its config.json and "
                           f"would be dropped, e.g. {unmapped[:3]}; is config.json the one these weights belong to?")
    finish_check = _shape_check(config, {name: ckpt.shape(name) for rule in rules for name in rule.hf},
                                source=str(hf_dir), transformers=transformers_shape_check,
                                background=workers > 1 and total >= BACKGROUND_SHAPE_CHECK_BYTES)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="hf->megatron", disable=not progress)
    buffers = dist_ckpt_io.BufferPool(chunk_bytes)

    def counted(read, layered: bool):
        def data() -> torch.Tensor:
            tensor = read()
            bar.update(tensor.numel() * tensor.element_size())
            return tensor.unsqueeze(0) if layered else tensor
        return data

    chunks: dict[str, list] = {}
    dtypes: dict[str, torch.dtype] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rule in rules:
        key, layer, count = dense.checkpoint_key(rule.megatron, arch)
        full = dense.megatron_shape(rule, [ckpt.shape(name) for name in rule.hf])
        dtype = ckpt.dtype(rule.hf[0])
        if any(ckpt.dtype(name) != dtype for name in rule.hf):
            raise CheckpointError(f"{hf_dir}: {rule.hf} are fused into one Megatron tensor but have different dtypes; "
                                  "save the checkpoint in one dtype")
        layered = layer is not None
        shape = (count, *full) if layered else full
        if shapes.setdefault(key, shape) != shape or dtypes.setdefault(key, dtype) != dtype:
            raise CheckpointError(f"{hf_dir}: layers disagree on the shape or dtype of {key} ({rule.hf[0]} is "
                                  f"{full} {dtype}); the weights do not fit config.json")
        for offsets, sizes, read in _chunks(rule, full, dtype, ckpt, arch, tensor_parallel=tensor_parallel,
                                            chunk_bytes=chunk_bytes, buffers=buffers):
            if layered:
                offsets, sizes = (layer, *offsets), (1, *sizes)
            chunks.setdefault(key, []).append((offsets, sizes, counted(read, layered)))
    # Megatron's ShardedObject naming: key/shard_{offset}_{shape}, holding the list of per-rank objects.
    objects = {name: [None] for name in dense.extra_state_objects(arch)}
    try:
        dist_ckpt_io.save(out_dir, tensors={key: (shapes[key], dtypes[key], parts) for key, parts in chunks.items()},
                          objects=objects, buffers=buffers, workers=workers, before_commit=finish_check)
    except Exception as exc:
        if not isinstance(exc, CheckpointError):
            finish_check()  # weights that do not fit config.json fail the conversion anywhere: say that
        raise
    bar.close()
    return Path(out_dir)


def megatron_to_hf(*, megatron_dir: str | Path, hf_config_dir: str | Path, out_dir: str | Path,
                   max_shard_bytes: int = 2 << 30, progress: bool = True,
                   transformers_shape_check: bool = False) -> list[Path]:
    """Write the torch_dist checkpoint in `megatron_dir` as HF safetensors shards in `out_dir`, with config.json
    and the tokenizer files copied from `hf_config_dir`. Returns the shard files."""
    config = read_hf_config(hf_config_dir)
    arch = architecture_from_hf(config)
    ckpt = dist_ckpt_io.DistCheckpoint(megatron_dir)
    rules = dense.model_rules(arch)
    # A trainer checkpoint also holds the optimizer's state ("optimizer.*"): not weights.
    unused = sorted(key for key in ckpt.keys() if not key.startswith("optimizer.")
                    and key not in {dense.checkpoint_key(rule.megatron, arch)[0] for rule in rules})
    if unused:
        raise CheckpointError(f"{megatron_dir}: holds weights that {hf_config_dir}/config.json does not describe, "
                              f"e.g. {unused[:3]}: pass the config of the model that was converted")
    plan, specs = [], []
    for rule in rules:
        key, layer, count = dense.checkpoint_key(rule.megatron, arch)
        meta = ckpt.meta(key)
        if layer is not None:
            if meta.shape[0] != count:
                raise CheckpointError(f"{megatron_dir}: {key} has {meta.shape[0]} layers, {hf_config_dir}/config.json "
                                      f"says {count}: pass the config of the model that was converted")
            meta = meta[0]
        plan.append((rule, key, layer, meta))
        specs += zip(rule.hf, dense.to_hf(rule, meta, arch))
    check_shapes({name: tuple(meta.shape) for name, meta in specs},
                 expected_hf_shapes(config, transformers=transformers_shape_check),
                 source=str(megatron_dir), config=f"{hf_config_dir}/config.json")

    def tensors():
        for rule, key, layer, meta in plan:
            if layer is None:
                full = ckpt.read(key, offsets=(0,) * meta.dim(), sizes=tuple(meta.shape))
            else:
                full = ckpt.read(key, offsets=(layer, *[0] * meta.dim()), sizes=(1, *meta.shape))[0]
            yield from zip(rule.hf, dense.to_hf(rule, full, arch))

    return _write_hf(out_dir, specs, tensors(), side_files_from=Path(hf_config_dir), desc="megatron->hf",
                     max_shard_bytes=max_shard_bytes, progress=progress)


def dequantize_hf(*, hf_dir: str | Path, out_dir: str | Path, max_shard_bytes: int = 2 << 30,
                  progress: bool = True) -> list[Path]:
    """Write the block-scaled FP8 HF checkpoint in `hf_dir` as bf16 HF safetensors shards in `out_dir` (every tensor,
    multi-token-prediction layers included, streamed one at a time), with config.json (without its
    `quantization_config`) and the tokenizer files: what rollout engines serve and weight sync updates in bf16."""
    config = read_hf_config(hf_dir)
    architecture_from_hf(config)
    if not config.get("quantization_config"):
        raise CheckpointError(f"{hf_dir}: config.json has no quantization_config; the checkpoint is not quantized")
    ckpt = HFCheckpoint(hf_dir)
    specs = [(name, torch.empty(ckpt.shape(name), dtype=ckpt.dtype(name), device="meta")) for name in ckpt.names()]
    tensors = ((name, ckpt.get(name)) for name in ckpt.names())
    return _write_hf(out_dir, specs, tensors, side_files_from=Path(hf_dir), desc="fp8->bf16",
                     max_shard_bytes=max_shard_bytes, progress=progress)


def _write_hf(out_dir: str | Path, specs: list[tuple[str, torch.Tensor]], tensors, *, side_files_from: Path,
              desc: str, max_shard_bytes: int, progress: bool) -> list[Path]:
    """Stream `tensors` ((name, tensor) in the order of `specs`, their meta shapes) into HF safetensors shards in
    `out_dir` with a byte progress bar, then copy config.json and the tokenizer files from `side_files_from`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=sum(m.numel() * m.element_size() for _, m in specs), unit="B", unit_scale=True, desc=desc,
               disable=not progress)

    def counted():
        for name, tensor in tensors:
            bar.update(tensor.numel() * tensor.element_size())
            yield name, tensor

    files = write_hf_shards(out_dir, specs, counted(), max_shard_bytes=max_shard_bytes)
    bar.close()
    _copy_side_files(side_files_from, out_dir)
    return files


_SIDE_FILE_SUFFIXES = {".json", ".txt", ".model", ".jinja", ".tiktoken"}


def _copy_side_files(src: Path, dst: Path) -> None:
    """config.json, generation config and tokenizer files: everything but weights and the weight index."""
    for file in src.iterdir():
        if file.is_file() and file.suffix in _SIDE_FILE_SUFFIXES and file.name != INDEX:
            shutil.copy2(file, dst / file.name)
    config = read_hf_config(dst)
    if config.pop("quantization_config", None) is not None:  # the weights written are bf16: say so
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
