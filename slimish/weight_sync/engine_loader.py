"""The weight loader slimish registers in its SGLang engines (`--custom-weight-loader`, `engine_flags.SHARD_LOADER`):
it runs inside each engine rank, called by SGLang's own `update_weights_from_tensor` when a request names it as its
`load_format`, with that rank's entry of `serialized_named_tensors` (SGLang hands rank r entry r).

The sharded `disk` transport writes each engine rank's parameters (SGLang names, that rank's layout:
`slimish.weight_sync.sharding.EngineShards`) to safetensors files of its own, and sends each rank
[(path of one of its files, a one-element int64 tensor holding the file's size)]: the rank reads only its own files
and copies each tensor into the parameter of its name (SGLang's `default_weight_loader`, shape checked), as
`load_format="direct"` copies tensors handed over in memory.

The sharded `broadcast` transport sends each rank [(a JSON description of its part of the bucket, a marker
tensor)]: `receive_shard` joins, once per group name, a group of its own with the sender (SGLang's
`init_custom_process_group`, as its /init_weights_update_group does: the sender at rank 0, rank r of every engine
after it), receives its part as one flat buffer broadcast over that group, and copies each tensor into the parameter
of its name. Groups of earlier connections (another name) are destroyed when a new one is joined.
It runs in the engine: of slimish it imports only `slimish.collectives` (torch), lazily.
"""

from __future__ import annotations

import json
import os

# Group name -> this rank's group with the sender (`receive_shard`), kept from bucket to bucket.
_GROUPS: dict = {}


def load_shard_files(model, named_tensors) -> None:
    """Load this rank's shard files named in `named_tensors` ([(path, its size in bytes as a tensor)]) into `model`
    by parameter name. A file of another size than the sender wrote (truncated, replaced) is refused."""
    from safetensors import safe_open
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    for path, size in named_tensors:
        found = os.path.getsize(path)
        if found != int(size.item()):
            raise RuntimeError(f"weight shard {path}: {found} bytes, the sender wrote {int(size.item())}")
        with safe_open(path, framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if name not in params:
                    raise KeyError(f"weight shard {path}: no parameter {name} on this engine rank")
                default_weight_loader(params[name], shard.get_tensor(name))


def receive_shard(model, named_tensors) -> None:
    """Receive this rank's part of a bucket broadcast over its own group and load it by name. `named_tensors`:
    [(JSON {"group", "address", "port", "world_size", "rank", "backend", "names", "dtypes", "shapes", "offsets",
    "nbytes"}, a marker tensor)]."""
    import torch
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    ((spec, _),) = named_tensors
    spec = json.loads(spec)
    group = _join(spec)
    device = next(model.parameters()).device
    flat = torch.empty(spec["nbytes"], dtype=torch.uint8, device=device)
    from slimish import collectives

    collectives.broadcast(flat, src=0, group=group)
    params = dict(model.named_parameters())
    for name, dtype, shape, start in zip(spec["names"], spec["dtypes"], spec["shapes"], spec["offsets"]):
        dtype = getattr(torch, dtype)
        numel = 1
        for size in shape:
            numel *= size
        tensor = flat[start:start + numel * dtype.itemsize].view(dtype).view(shape)
        if name not in params:
            raise KeyError(f"weight shard of group {spec['group']}: no parameter {name} on this engine rank")
        default_weight_loader(params[name], tensor)


def _join(spec: dict):
    import torch
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.utils.network import NetworkAddress

    if spec["group"] in _GROUPS:
        return _GROUPS[spec["group"]]
    for name in list(_GROUPS):  # an earlier connection's: its sender is gone
        try:
            torch.distributed.destroy_process_group(_GROUPS.pop(name))
        except Exception:  # noqa: BLE001 - a group whose peer died may fail to tear down; it is dropped anyway
            pass
    _GROUPS[spec["group"]] = init_custom_process_group(
        backend=spec["backend"], init_method=NetworkAddress(spec["address"], spec["port"]).to_tcp(),
        world_size=spec["world_size"], rank=spec["rank"], group_name=spec["group"])
    return _GROUPS[spec["group"]]
