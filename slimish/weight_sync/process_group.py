"""A torch.distributed group between trainer rank 0 and the engines, separate from the trainer's default group.

It must be created exactly as SGLang's engines create their side (`init_custom_process_group` in sglang): a TCP
rendezvous at master_address:master_port whose store is wrapped in a PrefixStore named after the group. The
trainer is rank 0 and hosts the store, listening on master_address only (slimish/network.py).
"""

from __future__ import annotations

from datetime import timedelta

import torch

# The sender's bound on joining the group and on one bucket's broadcast (the engines' side of the group keeps
# torch's default, 30 minutes).
WEIGHT_UPDATE_GROUP_TIMEOUT = timedelta(minutes=10)


def new_weight_update_group(*, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                            group_name: str, timeout: timedelta = WEIGHT_UPDATE_GROUP_TIMEOUT,
                            join_timeout: timedelta | None = None):
    """The group (see the module docstring); its collectives time out after `timeout`, its rendezvous after
    `join_timeout` (default: `timeout`; gloo's rendezvous waits as long as the group's timeout, not the store's)."""
    from torch.distributed import distributed_c10d as c10d

    from slimish.network import hosted_store

    if rank == 0:
        store = hosted_store(master_address, master_port, world_size=world_size, timeout=timeout)[0]
    else:
        store = torch.distributed.TCPStore(master_address, master_port, world_size, False, timeout)
    store = c10d.PrefixStore(group_name, store)
    options_key = "backend_options" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6) \
        else "pg_options"
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=group_name, timeout=join_timeout or timeout,
                                              **{options_key: None})
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    if join_timeout is not None:
        torch.distributed.set_timeout(timeout, group)
    return group


def destroy_group(group) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def abort_group(group, backend: str) -> None:
    """End `group` after a failed or given-up collective: on NCCL its communicator aborted with torch's own
    `_abort_process_group` (ncclCommAbort: a kernel still waiting for a peer ends, the stream is free again;
    UNVERIFIED on the sharded route's per-rank groups, see docs/gpu.md), any other group destroyed (gloo's destroy
    returns at once even with a send pending; keep the group referenced until that send ends,
    `transport.keep_until_done`)."""
    if backend == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group(group)
    else:
        destroy_group(group)
