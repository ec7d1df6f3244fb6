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


def load_by_name(model, named_tensors) -> None:
    """`load_format="direct"` plus the model's own post-processing: each tensor copied into the parameter of its name
    (SGLang's `default_weight_loader`, shape checked), then, for the parameters SGLang derives buffers from after
    loading (MLA's `w_kc` / `w_vc` from `kv_b_proj`), the model's `post_load_weights` for the layers loaded, as its
    own `load_weights` does. The tensor transport's sharded load for such models."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    for name, tensor in named_tensors:
        default_weight_loader(params[name], tensor)
    post_load(model, [name for name, _ in named_tensors])


def post_load(model, names: list[str]) -> None:
    """The model's post-processing of the parameters `names` just loaded by name: DeepSeek-V2/V3's
    `post_load_weights(weight_names=...)` re-derives `w_kc` / `w_vc` of the layers whose `kv_b_proj` was loaded
    (what its `load_weights` calls after a load; `/end_weight_update` skips it once weights were loaded)."""
    if any("kv_b_proj" in name for name in names) and hasattr(model, "post_load_weights"):
        model.post_load_weights(weight_names=names)


def load_shard_files(model, named_tensors) -> None:
    """Load this rank's shard files named in `named_tensors` ([(path, its size in bytes as a tensor)]) into `model`
    by parameter name. A file of another size than the sender wrote (truncated, replaced) is refused."""
    from safetensors import safe_open
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params, loaded = dict(model.named_parameters()), []
    for path, size in named_tensors:
        found = os.path.getsize(path)
        if found != int(size.item()):
            raise RuntimeError(f"weight shard {path}: {found} bytes, the sender wrote {int(size.item())}")
        with safe_open(path, framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if name not in params:
                    raise KeyError(f"weight shard {path}: no parameter {name} on this engine rank")
                default_weight_loader(params[name], shard.get_tensor(name))
                loaded.append(name)
    post_load(model, loaded)


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
    post_load(model, spec["names"])


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
