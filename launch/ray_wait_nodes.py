"""Wait until a Ray cluster has the expected number of alive nodes (used by launch/train.sbatch).

    python launch/ray_wait_nodes.py --address HOST:PORT --nodes N [--timeout SECONDS]

Connects to the cluster as a short-lived driver, polls `ray.nodes()` and prints one line per alive node once
all N are there (exit 0), or what it saw at the deadline (exit 1).
"""

from __future__ import annotations

import argparse
import sys
import time


def _alive_nodes(ray) -> list[dict]:
    return [node for node in ray.nodes() if node["Alive"]]


def _describe(node: dict) -> str:
    resources = node.get("Resources", {})
    return (
        f"node={node.get('NodeName', '?')} address={node['NodeManagerAddress']}:{node['NodeManagerPort']}"
        f" cpus={resources.get('CPU', 0):g} gpus={resources.get('GPU', 0):g}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="GCS address of the head, HOST:PORT")
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes to wait for")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before giving up")
    args = parser.parse_args()

    import ray

    deadline = time.monotonic() + args.timeout
    # ray.init fails fast while the GCS is still starting: retry until the deadline.
    while True:
        try:
            ray.init(address=args.address, logging_level="WARNING", log_to_driver=False)
            break
        except (ConnectionError, RuntimeError) as exc:
            if time.monotonic() > deadline:
                print(f"ray_wait_nodes: cannot connect to {args.address}: {exc}", file=sys.stderr)
                return 1
            time.sleep(1.0)
    try:
        while True:
            nodes = _alive_nodes(ray)
            if len(nodes) >= args.nodes or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        ok = len(nodes) >= args.nodes
        print(f"ray cluster: {len(nodes)}/{args.nodes} nodes alive" + ("" if ok else f" after {args.timeout:g}s"))
        for node in sorted(nodes, key=lambda n: n.get("NodeName", "")):
            print(f"ray node: {_describe(node)}")
        return 0 if ok else 1
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
