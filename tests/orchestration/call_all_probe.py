"""Run by test_trainer_group.py in a process of its own (a local Ray): prints how often TrainerGroup.call_all
pickled one argument that it sent to three ranks."""

from __future__ import annotations

import ray

from slimish.orchestration.ray_cluster import TrainerGroup

PICKLED = []


class Payload:
    """Stands for a step's samples: counts its own pickling in this (the driver's) process."""

    def __reduce__(self):
        PICKLED.append(1)
        return (Payload, ())


class Rank:
    def step(self, payload, *, version):
        return type(payload).__name__, version


if __name__ == "__main__":
    ray.init(num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        group = TrainerGroup([ray.remote(Rank).options(num_cpus=0.01).remote() for _ in range(3)])  # no trainers
        results = group.call_all("step", Payload(), version=7)
        print(f"results={results} pickled={len(PICKLED)}")
    finally:
        ray.shutdown()
