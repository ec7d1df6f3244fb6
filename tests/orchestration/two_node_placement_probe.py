"""Run by test_placement.py in a process of its own: a simulated Ray cluster of two nodes on this host
(`ray.cluster_utils.Cluster`, each node a raylet of its own declaring 3 GPUs: Ray schedules declared GPUs as it does
real ones; no actor is started, so nothing uses them). Prints, one line each:
- `one-gpu-bundles`: 4 trainer ranks reserved the old way (one PACKed group of single-GPU bundles), which fills one
  node and puts the last rank on the other: the tensor-parallel group {2, 3} crosses nodes;
- `grouped`: the nodes of the same 4 ranks at tensor_parallel 2 through `reserve_grouped`;
- `too-large`: what a tensor-parallel group of 4 (more than a node's 3 GPUs) is told;
- `colocated-ep`: what a colocated job with expert parallelism and the tensor transport on those GPUs is told.
Node ids are printed as n0 / n1 in the order they first appear."""

from __future__ import annotations

import ray
from ray.cluster_utils import Cluster

from slimish.errors import UserError
from slimish.orchestration.placement import (
    colocated_sender_problem,
    release,
    reserve,
    reserve_grouped,
    trainer_group_size,
)


def names(slots) -> list[str]:
    seen: dict[str, str] = {}
    return [seen.setdefault(slot.node_id, f"n{len(seen)}") for slot in slots]


def crossing(slots, size: int) -> list[int]:
    """The groups (of `size` consecutive ranks) whose ranks are on more than one node, by index."""
    return [k for k in range(len(slots) // size) if len({s.node_id for s in slots[k * size:(k + 1) * size]}) > 1]


if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 3,
                                                            "include_dashboard": False,
                                                            "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=1, num_gpus=3, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address)
    try:
        cluster.wait_for_nodes()
        old = reserve("slimish-trainer", count=4, gpus_each=1, timeout_s=60)
        # Which node PACK fills first is Ray's choice: 3 ranks on one node and 1 on the other, either way round.
        print(f"one-gpu-bundles per node {sorted(names(old).count(n) for n in set(names(old)))} "
              f"groups crossing nodes {len(crossing(old, 2))}")
        release(old)
        size = trainer_group_size(tensor_parallel=2, expert_parallel=1, node_gpus=3)
        grouped = reserve_grouped("slimish-trainer", count=4, group_size=size, gpus_each=1, timeout_s=60)
        print(f"grouped {names(grouped)} bundles={[slot.bundle for slot in grouped]} "
              f"groups={len({slot.group.id for slot in grouped})} groups crossing nodes {len(crossing(grouped, 2))}")
        print(f"colocated-ep {colocated_sender_problem(grouped, transport='tensor', expert_parallel=2)}")
        print(f"colocated-ep-disk {colocated_sender_problem(grouped, transport='disk', expert_parallel=2)}")
        release(grouped)
        print(f"ep-block {trainer_group_size(tensor_parallel=1, expert_parallel=2, node_gpus=3)} "
              f"{trainer_group_size(tensor_parallel=2, expert_parallel=2, node_gpus=3)}")
        try:
            reserve_grouped("slimish-trainer", count=4, group_size=4, gpus_each=1, timeout_s=60)
        except UserError as exc:
            print(f"too-large {exc}")
    finally:
        ray.shutdown()
        cluster.shutdown()
