"""Read a tensor-parallel rank's slice of a Megatron parameter straight from the HF safetensors: only its bytes.

The result equals `sharding.shard(dense.to_megatron(rule, whole HF tensors), ...)`, which is what the bridge did
before (a whole read per rank, then the slice): TP ranks of one stage each read the stage once, and so did every
data-parallel replica. Here:

- column-parallel parameters (`partition_dim` 0: q/k/v, gate/up, embedding, output layer, MLA's projections) read
  their rows, one contiguous range per HF tensor. Fused q/k/v is assembled from this rank's query groups of q, k and
  v; gate/up from its rows of each;
- row-parallel parameters (`partition_dim` 1: o_proj, down_proj) read their columns: one positioned read per row of
  the HF tensor, each `cols / TP` wide (`HFCheckpoint.get(cols=)`). The trade-off against reading whole rows and
  slicing in memory: 1/TP of the bytes, for one system call per row (16384 for a 405B o_proj: 0.09 s of calls per
  tensor measured on a warm cache); on a cold cache the device still reads whole pages (and the kernel reads
  ahead), so a slice narrower than a page (4 KiB: a bf16 row of 16384 columns at TP 8 is exactly 4 KiB) saves
  copies out of the page cache, not disk reads.
- MLA's rotary rows are reordered per block after the read when a rank's rows are whole blocks (per head for q);
  otherwise (the kv down projection's single block split over TP), and for anything else this module does not know
  how to slice, the whole tensors are read and sliced as before (`fallbacks` counts those).

Experts and layers need nothing here: the bridge asks only for the rules of this stage's layers and of this
expert-parallel rank's experts (`bridge._rules_for`).
"""

from __future__ import annotations

import torch

from slimish.megatron_bridge import dense, mla, sharding
from slimish.megatron_bridge.hf_config import Architecture
from slimish.megatron_bridge.hf_io import HFCheckpoint
from slimish.megatron_bridge.rule import Rule


def _even_part(length: int, parts: int, index: int) -> tuple[int, int] | None:
    """[start, stop) of part `index` of `length` split in `parts` equal parts; None when they are not equal."""
    if length % parts:
        return None
    size = length // parts
    return index * size, (index + 1) * size


def read_whole(rule: Rule, param: torch.Tensor, ckpt: HFCheckpoint, arch: Architecture, *, tp_rank: int,
               tp_size: int) -> torch.Tensor:
    """The rank's slice, read the way the bridge did before slice reads: whole HF tensors, then sliced."""
    full = dense.to_megatron(rule, [ckpt.get(name) for name in rule.hf], arch)
    return sharding.shard(full, param, rule.kind, tp_rank, tp_size)


def read_local(rule: Rule, param: torch.Tensor, ckpt: HFCheckpoint, arch: Architecture, *, tp_rank: int,
               tp_size: int) -> tuple[torch.Tensor, bool]:
    """(this rank's slice of the rule's Megatron tensor for `param`, whether it was read whole: a fallback)."""
    if tp_size == 1 or not sharding.is_tp_sharded(param):
        return dense.to_megatron(rule, [ckpt.get(name) for name in rule.hf], arch), False
    local = read_part(rule, param.partition_dim, ckpt, arch, tp_rank, tp_size)
    if local is not None:
        return local, False
    return read_whole(rule, param, ckpt, arch, tp_rank=tp_rank, tp_size=tp_size), True


def splits_evenly(rule: Rule, dim: int, ckpt: HFCheckpoint, arch: Architecture, size: int) -> bool:
    """Whether `read_part` reads part r of `size` of the rule's Megatron tensor split along `dim` (from the shapes
    alone: no data read), rather than returning None."""
    shape = ckpt.shape(rule.hf[0])
    if dim == 1:
        return rule.kind == "copy" and len(shape) == 2 and shape[1] % size == 0
    if dim != 0:
        return False
    if rule.kind in ("copy", "gate_up"):
        return all(ckpt.shape(name)[0] % size == 0 for name in rule.hf)
    if rule.kind in ("qkv", "qkv_bias"):
        return dense.qkv_widths(arch)[0] % size == 0
    if rule.kind in mla.ROPE_KINDS:
        return shape[0] % size == 0 and (shape[0] // size) % mla.rope_block(rule, arch)[0] == 0
    return False


def read_part(rule: Rule, dim: int, ckpt: HFCheckpoint, arch: Architecture, rank: int,
              size: int) -> torch.Tensor | None:
    """Part `rank` of `size` of the rule's Megatron tensor split along `dim` as Megatron's tensor parallelism splits
    it (gate/up: that part of each half), reading only its bytes; None where this module cannot (`splits_evenly`)."""
    first = rule.hf[0]
    shape = ckpt.shape(first)
    if dim == 1:  # row-parallel: this rank's columns
        cols = _even_part(shape[1], size, rank) if rule.kind == "copy" and len(shape) == 2 else None
        return ckpt.get(first, cols=cols) if cols is not None else None
    if dim != 0:
        return None
    if rule.kind in ("copy", "gate_up"):  # gate/up: this rank's rows of each, stacked as Megatron shards them
        parts = [_even_part(ckpt.shape(name)[0], size, rank) for name in rule.hf]
        if None in parts:
            return None
        slices = [ckpt.get(name, rows=rows) for name, rows in zip(rule.hf, parts)]
        return slices[0] if len(slices) == 1 else torch.cat(slices, dim=0)
    if rule.kind in ("qkv", "qkv_bias"):  # this rank's query groups of q, k and v, interleaved
        groups, q_width, kv_width = dense.qkv_widths(arch)
        if groups % size:
            return None
        local = groups // size
        widths = (q_width, kv_width, kv_width)
        hf = [ckpt.get(name, rows=(rank * local * width, (rank + 1) * local * width))
              for name, width in zip(rule.hf, widths)]
        return dense.fuse_qkv(hf, arch, groups=local)
    if rule.kind in mla.ROPE_KINDS:  # whole rotary blocks per rank: reorder them after the read
        rows = _even_part(shape[0], size, rank)
        block, _ = mla.rope_block(rule, arch)
        if rows is None or (rows[1] - rows[0]) % block:
            return None
        return mla.to_megatron(rule, [ckpt.get(first, rows=rows)], arch)
    return None
