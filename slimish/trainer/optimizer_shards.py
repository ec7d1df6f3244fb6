"""The distributed optimizer's state in a checkpoint, saved and loaded by each rank for its own shard only.

Megatron-Core 0.16's DistributedOptimizer offers three formats, none of which fits:
- `fully_reshardable` all-gathers the stage's fp32 main params, Adam m and v over the data-parallel group on save
  (every rank then holds the whole stage's: 12 bytes per parameter of the stage) and has every rank read the whole
  stage's back on load, to slice it;
- `dp_reshardable` saves each rank's buckets as they are, with no gather, but loads only at the same TP / PP layout
  and bucket structure (its tensors are the flat gradient buffers, not the parameters);
- `fully_sharded_model_space`, no gather and any layout, describes a rank's shard as a `flattened_range` of each
  parameter, which 0.16's ShardedTensor refuses.

This module keeps `fully_sharded_model_space`'s layout and describes it with regular ShardedTensors: a rank's shard of
a parameter is a contiguous range of the (local, TP / EP-split) parameter flattened; a range of a row-major tensor is
at most 2 x ndim - 1 boxes (a partial row, whole rows, a partial row, recursively), and each box is a regular chunk
of the global tensor, under the key `fully_reshardable` gives the whole tensor (optimizer.state.<param | exp_avg |
exp_avg_sq>.<model key>). So:
- on save, every rank describes views of its own optimizer state: nothing is gathered (Megatron's writer then
  stages a host copy of what the rank writes: its shard, 12 / DP bytes per parameter of its model slice);
- on load, every rank asks for its boxes only and torch's DCP reads them, in place, into the optimizer's state;
- the checkpoint holds global tensors, so it loads at any TP / PP / DP / EP layout; a checkpoint written in
  `fully_reshardable` (slimish before this module) has the same keys and shapes and loads the same way.

`install(part)` makes one DistributedOptimizer save and load this way (its `sharded_state_dict` and `load_state_dict`,
per instance); the param groups and step go through Megatron's own code, as with `fully_reshardable`.
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

FORMAT = "slimish_model_space"  # the param_state_sharding_type this module writes
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # fully_reshardable's names: its checkpoints load here too
_LOADABLE = (FORMAT, "fully_reshardable")


def boxes(start: int, end: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat range [start, end) of a row-major tensor of `shape` as boxes (offset, shape), in flat order."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if first == last:  # within one row: a range of the sub-tensor
        return [((first, *offset), (1, *size)) for offset, size in boxes(start - first * row, end - first * row,
                                                                         shape[1:])]
    out = []
    if start % row:  # the partial first row
        out += boxes(start, (first + 1) * row, shape)
        first += 1
    whole_end = end // row
    if whole_end > first:
        out.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if end % row:  # the partial last row
        out += boxes(whole_end * row, end, shape)
    return out


def _model_tensors(sharded) -> list:
    """The regular ShardedTensors a model entry stands for: itself, or what a ShardedTensorFactory (Megatron's
    gated MLP splits fc1 in two) builds, built on the meta device so that their flat positions in the local
    parameter can be read off the views."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if not isinstance(sharded, ShardedTensorFactory):
        return [sharded]
    meta = torch.empty(sharded.data.shape, dtype=sharded.data.dtype, device="meta")
    built = list(nested_values(replace(sharded, data=meta).build()))
    for tensor in built:
        if not tensor.data.is_contiguous():
            raise NotImplementedError(f"{sharded.key}: a factory's non-contiguous piece; its optimizer state cannot "
                                      "be saved in shards")
    return built


def _pieces(part, model_param, model_entry, state: dict) -> list:
    """(state key, where its view starts in this rank's shard, ShardedTensor) for every box of this rank's shard of
    `model_param`; each ShardedTensor's data is a view of the optimizer's `state`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    start, end = _shard_range(part, model_param)
    out = []
    for model_tensor in _model_tensors(model_entry):
        base = model_tensor.data.storage_offset() if model_tensor.data.device.type == "meta" else 0
        lo, hi = max(start, base), min(end, base + model_tensor.data.numel())
        local = tuple(model_tensor.data.shape)
        prepend = model_tensor.prepend_axis_num
        replica_id = (*model_tensor.replica_id[:2], part.distributed_optimizer_instance_id)
        for offset, size in boxes(lo - base, hi - base, local):
            first = base + sum(o * math.prod(local[i + 1:]) for i, o in enumerate(offset)) - start
            # Megatron's prepended axes (the layer number) as axes of size 1: its writer takes irregular chunks
            # only without prepended axes.
            shape = (1,) * prepend + size
            for key in STATE_KEYS:
                view = state[key].view(-1)[first:first + math.prod(size)].view(shape)
                out.append((key, first, ShardedTensor(
                    key=f"optimizer.state.{key}.{model_tensor.key}", data=view, dtype=view.dtype, local_shape=shape,
                    global_shape=model_tensor.global_shape,
                    global_offset=(*model_tensor.global_offset[:prepend],
                                   *(g + o for g, o in zip(model_tensor.global_offset[prepend:], offset))),
                    axis_fragmentations=None, replica_id=replica_id,
                    allow_shape_mismatch=model_tensor.allow_shape_mismatch)))
    return out


def _shard_range(part, model_param) -> tuple[int, int]:
    for gbuf_range_maps in part.gbuf_ranges:
        for bucket_maps in gbuf_range_maps.values():
            for bucket_map in bucket_maps:
                if model_param in bucket_map["param_map"]:
                    param_range = bucket_map["param_map"][model_param]["param"]
                    return param_range.start, param_range.end
    raise KeyError("parameter without a shard on this rank")


def _local_params(part) -> list:
    """This rank's parameters with a shard, in Megatron's order (fully_sharded_model_space's)."""
    return [param for gbuf_range_maps in part.gbuf_ranges for bucket_maps in gbuf_range_maps.values()
            for bucket_map in bucket_maps for param in bucket_map["param_map"]]


def _states(part, model_param) -> dict:
    tensors = part._get_main_param_and_optimizer_states(model_param)
    return {key: tensors[key] for key in STATE_KEYS}


def _built(part, model_sharded_state_dict: dict) -> dict:
    """{parameter index: _pieces} for every parameter with a shard on this rank."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model_entries, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {entry.data: entry for entry in nested_values(model_entries)}
    return {index: _pieces(part, param, by_param[param], _states(part, param))
            for index, param in enumerate(_local_params(part))}


def param_state(part, model_sharded_state_dict: dict) -> dict:
    """{parameter index: [ShardedTensor, ...]}: this rank's shard of every parameter's main weight and Adam moments,
    as views of the optimizer's state (what a save writes and a load fills)."""
    return {index: [tensor for _, _, tensor in pieces]
            for index, pieces in _built(part, model_sharded_state_dict).items()}


def install(part) -> None:
    """Make the DistributedOptimizer `part` save its parameter state in this module's format and load it (or
    fully_reshardable's) from it. Idempotent."""
    if "_slimish_shards" in vars(part):
        return
    part._slimish_shards = {}  # parameter index -> [(state key, start in the shard, view)]: the last load's targets
    load_state_dict = part.load_state_dict

    def sharded(model_sharded_state_dict, is_loading=False, **kwargs):
        """Megatron's sharded_state_dict for fully_reshardable (its `metadata` only keys the ChainedOptimizer's
        parts), with this module's param_state."""
        state_dict = part.state_dict()
        if is_loading:  # as Megatron does: the optimizer's state exists (allocated once) before it is filled
            load_state_dict(part.state_dict())
        built = _built(part, model_sharded_state_dict)
        part._slimish_shards = {index: [(key, first, tensor.data) for key, first, tensor in pieces]
                                for index, pieces in built.items()}
        state_dict["param_state"] = {index: [tensor for _, _, tensor in pieces] for index, pieces in built.items()}
        state_dict["param_state_sharding_type"] = FORMAT
        return state_dict

    def load(state_dict):
        state_dict = dict(state_dict)
        loaded, kind = state_dict.pop("param_state", None), state_dict.pop("param_state_sharding_type", None)
        load_state_dict(state_dict)  # param groups, step, grad scaler: Megatron's own
        if loaded is None:
            return
        if kind not in _LOADABLE:
            raise NotImplementedError(f"distributed optimizer state of format {kind!r}: slimish loads "
                                      f"{', '.join(_LOADABLE)}")
        _apply(part, loaded)

    part.sharded_state_dict, part.load_state_dict = sharded, load


@torch.no_grad()
def _apply(part, loaded: dict) -> None:
    """Put the loaded boxes into the optimizer's state. torch's reader fills the views it was given in place, so
    usually there is nothing to do; a box it returned elsewhere, or a state that is not the tensors the optimizer
    hands out (a precision-aware optimizer's scaled state), goes through the optimizer's own setter."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    copied = 0
    for index, param in enumerate(_local_params(part)):
        targets, tensors, current = part._slimish_shards[index], loaded[index], _states(part, param)
        if all(tensor.data_ptr() == view.data_ptr() and view.untyped_storage().data_ptr()
               == current[key].untyped_storage().data_ptr() for (key, _, view), tensor in zip(targets, tensors)):
            continue
        copied += 1
        flat = {key: torch.empty(current[key].numel(), dtype=current[key].dtype, device=current[key].device)
                for key in STATE_KEYS}
        for (key, first, _), tensor in zip(targets, tensors):
            flat[key][first:first + tensor.numel()].copy_(tensor.reshape(-1))
        part._set_main_param_and_optimizer_states(param, flat)
    if isinstance(part.optimizer, HybridDeviceOptimizer):
        part.optimizer._sync_hdo_state_to_sub_optimizers()
    part._slimish_copied = copied  # parameters whose boxes the last load copied (tests: 0 on the CPU)
    logger.debug("distributed optimizer shards of %d parameters loaded, %d of them through a copy",
                 len(part._slimish_shards), copied)
