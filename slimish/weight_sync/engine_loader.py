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
of its name. One connection (the spec's "connection") may have several senders, each with a group of its own per
engine rank (trainer rank 0's, and each expert owner's, `slimish.weight_sync.owners`): a rank keeps every group of
its connection, and destroys the groups of earlier connections when it first joins one of a new connection. A group's
rendezvous needs every engine's rank: the engines join in the order the requests reach them, which one poster (trainer
rank 0) keeps the same on every engine. Each join and receive is bounded by the bucket's deadline, which the entry
carries: past it, or once the receive fails, the group is aborted and forgotten and the request fails
(`receive_shard`).
It runs in the engine: of slimish it imports only `slimish.collectives` (torch), lazily.

Expert slots: every loader here also takes a tensor named `{stacked parameter}[{k}]`, e.g.
`model.layers.3.mlp.experts.w13_weight[5]`, and copies it into expert k (the rank's local index, counted from the
first expert of its expert-parallel block) of that stacked parameter: `param[k]`, shape checked. So one expert
travels alone, without waiting for the rest of its layer, and the experts of one parameter may come from different
senders (the trainer ranks that own them). `slot_name` / `parse_slot` are the encoding, on both ends.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import timedelta

_SLOT = re.compile(r"(.+)\[(\d+)\]")

# Group name -> (its connection, this rank's group with that sender) (`receive_shard`), kept from bucket to bucket.
_GROUPS: dict = {}
# (work, group) of receives given up (`_drop`), kept until the work ends.
_GIVEN_UP: list = []
_POLL_S = 0.002  # how often a receive looks at its broadcast and its deadline


def slot_name(param: str, index: int) -> str:
    """The name of expert `index`'s slot of stacked parameter `param` (see the module docstring)."""
    return f"{param}[{index}]"


def parse_slot(name: str) -> tuple[str, int | None]:
    """(parameter, expert slot) of a loader's tensor name; slot None: the whole parameter."""
    m = _SLOT.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def load_one(params: dict, name: str, tensor, where: str = "") -> str:
    """Copy `tensor` into the parameter (or expert slot, `parse_slot`) of `name` among `params`, shape checked;
    returns the parameter's name. `where` names the payload in errors."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    param, slot = parse_slot(name)
    if param not in params:
        raise KeyError(f"{where}no parameter {param} on this engine rank")
    if slot is None:
        default_weight_loader(params[param], tensor)
        return param
    stacked = params[param].data
    if slot >= stacked.shape[0] or stacked[slot].shape != tensor.shape:
        raise ValueError(f"{where}expert slot {name}: got a tensor of shape {tuple(tensor.shape)}, the parameter is "
                         f"{tuple(stacked.shape)}")
    stacked[slot].copy_(tensor)
    return param


def load_by_name(model, named_tensors) -> None:
    """`load_format="direct"` plus the model's own post-processing: each tensor copied into the parameter of its name
    (SGLang's `default_weight_loader`, shape checked), then, for the parameters SGLang derives buffers from after
    loading (MLA's `w_kc` / `w_vc` from `kv_b_proj`), the model's `post_load_weights` for the layers loaded, as its
    own `load_weights` does. The tensor transport's sharded load for such models, and for expert slots."""
    params = dict(model.named_parameters())
    post_load(model, [load_one(params, name, tensor) for name, tensor in named_tensors])


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

    params, loaded = dict(model.named_parameters()), []
    for path, size in named_tensors:
        found = os.path.getsize(path)
        if found != int(size.item()):
            raise RuntimeError(f"weight shard {path}: {found} bytes, the sender wrote {int(size.item())}")
        with safe_open(path, framework="pt", device="cpu") as shard:
            for name in shard.keys():
                loaded.append(load_one(params, name, shard.get_tensor(name), where=f"weight shard {path}: "))
    post_load(model, loaded)


def receive_shard(model, named_tensors) -> None:
    """Receive this rank's parts of a round of buckets, each broadcast by its sender over a group of its own, and load
    them by name. `named_tensors`: [(JSON {"group", "connection", "address", "port", "world_size", "rank", "backend",
    "names", "dtypes", "shapes", "offsets", "nbytes", "timeout_s"}, a marker tensor)], one entry per sender of the
    round (rank 0 and the other senders, `slimish.weight_sync.owners`); "connection" absent: the group is a
    connection of its own; "timeout_s" absent: unbounded, as before it was sent.

    The groups are joined in entry order (the same on every engine rank, so no two ranks wait on each other's
    rendezvous), then every broadcast is issued at once and waited for together: a round's bytes come over as many
    links as it has senders. Bounded by the round's deadline, `timeout_s` from the call (the sender's own:
    weight_sync.bucket_timeout_s plus the bytes at min_bandwidth_mib_s): the joins' rendezvous, then the broadcasts,
    issued asynchronously and polled. A sender that never comes, never sends or dies leaves this rank with one error
    (the update request fails) and the round's groups aborted and forgotten (`_drop`), never stuck inside a
    collective: the engine serves the next connection, whose groups have new names. Holds every part of the round at
    once: its receive buffers are the round's bytes for this rank (at most one bucket per sender)."""
    import torch

    from slimish import collectives

    specs = [json.loads(spec) for spec, _ in named_tensors]
    timeouts = [spec["timeout_s"] for spec in specs if spec.get("timeout_s") is not None]
    deadline = time.monotonic() + max(timeouts) if timeouts else None
    device = next(model.parameters()).device
    flats, works = [], []
    try:
        groups = [_join(spec) for spec in specs]
        for spec, group in zip(specs, groups):
            flats.append(torch.empty(spec["nbytes"], dtype=torch.uint8, device=device))
            if spec.get("timeout_s") is not None:  # the group's own timeout stays behind the deadline: `_receive`
                torch.distributed.set_timeout(_own_timeout(spec["timeout_s"]), group)
            works.append(collectives.broadcast(flats[-1], src=0, group=group, async_op=True))
        for spec, work in zip(specs, works):
            _receive(work, deadline, spec)
    except Exception:
        for index, spec in enumerate(specs):
            _drop(spec, works[index] if index < len(works) else None)
        raise
    params, loaded = dict(model.named_parameters()), []
    for spec, flat in zip(specs, flats):
        for name, dtype, shape, start in zip(spec["names"], spec["dtypes"], spec["shapes"], spec["offsets"]):
            dtype = getattr(torch, dtype)
            numel = 1
            for size in shape:
                numel *= size
            tensor = flat[start:start + numel * dtype.itemsize].view(dtype).view(shape)
            load_one(params, name, tensor, where=f"weight shard of group {spec['group']}: ")
            loaded.append(parse_slot(name)[0])
    post_load(model, loaded)


def _own_timeout(timeout_s: float):
    """The group's own timeout for a bucket due within `timeout_s`: twice that, so that this rank's poll (`_receive`)
    always gives up first. On NCCL the group's own timeout is the watchdog's, which would take the whole engine
    process down (TORCH_NCCL_ASYNC_ERROR_HANDLING's default); on gloo it ends a given-up receive in the background."""
    return timedelta(seconds=2 * timeout_s)


def _receive(work, deadline: float | None, spec: dict) -> None:
    """Wait for the broadcast `work` until `deadline` (monotonic; None: no bound), then raise its failure if it
    failed. Polled: on NCCL the host call has returned and the wait is the kernel's, which only an abort ends."""
    while deadline is not None and not work.is_completed():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"weight shard of group {spec['group']}: the sender's broadcast of {spec['nbytes']} "
                               f"bytes did not arrive within {spec['timeout_s']:.1f} s (the bucket's deadline: "
                               f"weight_sync.bucket_timeout_s, weight_sync.min_bandwidth_mib_s); the group is aborted")
        time.sleep(_POLL_S)
    work.wait()


def _drop(spec: dict, work) -> None:
    """Forget the group of `spec` after a failed receive and end it: NCCL's with torch's own abort (ncclCommAbort, which
    ends the kernel still waiting for the sender; UNVERIFIED, not run on a GPU), gloo's by destroying it. A gloo
    receive still pending keeps its group referenced until it ends (within the group's own timeout): the last
    reference's destructor joins the group's thread, blocked in that receive."""
    import torch

    if spec["group"] not in _GROUPS:
        return
    _, group = _GROUPS.pop(spec["group"])
    try:
        if spec["backend"] == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group(group)
        else:
            torch.distributed.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - a group whose peer died may fail to tear down; it is dropped anyway
        pass
    if work is not None and not work.is_completed():
        _GIVEN_UP[:] = [(w, g) for w, g in _GIVEN_UP if not w.is_completed()] + [(work, group)]


def _join(spec: dict):
    import torch
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.utils.network import NetworkAddress

    name, connection = spec["group"], spec.get("connection", spec["group"])
    if name in _GROUPS:
        return _GROUPS[name][1]
    for other in [n for n, (c, _) in _GROUPS.items() if c != connection]:  # an earlier connection's: its senders
        try:                                                                 # are gone
            torch.distributed.destroy_process_group(_GROUPS.pop(other)[1])
        except Exception:  # noqa: BLE001 - a group whose peer died may fail to tear down; it is dropped anyway
            pass
    # The rendezvous is bounded by the bucket's deadline, as the sender's is (`join_rank_groups`).
    timeout = {} if spec.get("timeout_s") is None else {"timeout": timedelta(seconds=spec["timeout_s"])}
    group = init_custom_process_group(
        backend=spec["backend"], init_method=NetworkAddress(spec["address"], spec["port"]).to_tcp(),
        world_size=spec["world_size"], rank=spec["rank"], group_name=name, **timeout)
    _GROUPS[name] = (connection, group)
    return group
