"""Run by test_placement.py in a process of its own (a local Ray of one node): prints what `reserve_engines` gives
engines of one node, and what it says of engines spanning two nodes there."""

from __future__ import annotations

import ray

from slimish.errors import UserError
from slimish.orchestration.placement import release, reserve_engines

if __name__ == "__main__":
    ray.init(num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        engines = reserve_engines(count=2, nodes_per_engine=1, gpus_each=0, timeout_s=60)
        print(f"parts={[len(parts) for parts in engines]} bundles={[parts[0].bundle for parts in engines]}")
        release([slot for parts in engines for slot in parts])
        try:
            reserve_engines(count=1, nodes_per_engine=2, gpus_each=0, timeout_s=60)
        except UserError as exc:
            print(f"error: {exc}")
    finally:
        ray.shutdown()
