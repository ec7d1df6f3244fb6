"""A stand-in for `slimish train` that proves the Slurm/Ray bootstrap without the trainer.

    SLIMISH_DRIVER_CMD="python tests/slurm/ray_probe_driver.py" sbatch -N 2 launch/train.sbatch CONFIG [overrides]

Takes the same arguments as `slimish train`, connects to RAY_ADDRESS, runs one Ray task pinned to each alive node,
and writes one metrics.jsonl line per step (rl.num_steps of them) naming the Slurm node every task ran on, and
whether it ran in tests/slurm/fake_container.sh.
PROBE_STEP_SECONDS (default 0.5) is the time one step takes, so that a test can cancel the job mid-run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from slimish.config import load_config


@ray.remote(num_cpus=1)
def _where() -> tuple[str, bool]:
    # Each Ray node inherits the environment of the srun step that started it, and of the (stand-in) container it
    # runs in, if any (tests/slurm/fake_container.sh).
    return os.environ.get("SLURMD_NODENAME", "?"), os.environ.get("IN_FAKE_CONTAINER") == "1"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    nodes = [node for node in ray.nodes() if node["Alive"]]
    step_seconds = float(os.environ.get("PROBE_STEP_SECONDS", "0.5"))
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        for step in range(1, cfg.rl.num_steps + 1):
            pinned = [
                _where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
                for node in nodes
            ]
            where = sorted(ray.get(pinned))
            slurm_nodes = [node for node, _ in where]
            metrics.write(json.dumps({"step": step, "ray_nodes": len(nodes), "slurm_nodes": slurm_nodes,
                                      "in_container": [inside for _, inside in where]}) + "\n")
            metrics.flush()
            print(f"probe step {step}: tasks ran on {slurm_nodes}", flush=True)
            time.sleep(step_seconds)


if __name__ == "__main__":
    main()
