"""Ray setup and the actor groups of a job.

Local runs start a private Ray on loopback only; with RAY_ADDRESS set (e.g. by launch/train.sbatch) the driver
joins that cluster instead. Actors ask Ray for no CPUs: the engines they spawn and the trainer's torch threads
are not Ray tasks, and on a 2-core machine a CPU reservation would only deadlock placement.
"""

from __future__ import annotations

import os

if not os.environ.get("RAY_ADDRESS"):
    # Read by Ray at import time: with it, a local Ray advertises and binds 127.0.0.1 instead of the host's
    # interface address. (A multi-node cluster is joined through RAY_ADDRESS and keeps Ray's defaults.)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from slimish.config.schema import JobConfig  # noqa: E402


def init_ray(cfg: JobConfig) -> None:
    env = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True, runtime_env={"env_vars": env})
        return
    ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=True, runtime_env={"env_vars": env})


class TrainerGroup:
    """All trainer ranks; every method call is sent to every rank (SPMD) and rank 0's result is returned."""

    def __init__(self, cfg: JobConfig):
        from slimish.trainer.worker import TrainerWorker

        actor_cls = ray.remote(num_cpus=0)(TrainerWorker)
        world = cfg.parallel.num_trainer_ranks
        self.actors = [actor_cls.remote(cfg, rank=rank, world_size=world) for rank in range(world)]

    def call(self, method: str, *args, **kwargs):
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])[0]

    def setup(self) -> dict:
        master_addr, master_port = ray.get(self.actors[0].address.remote())
        info = self.call("setup", master_addr=master_addr, master_port=master_port)
        return {**info, "trainer_master_addr": master_addr}

    def kill(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=5)
            except Exception:
                pass
            ray.kill(actor)


def rollout_actor(cfg: JobConfig, log_dir: str):
    from slimish.rollout.manager import RolloutManager

    return ray.remote(num_cpus=0)(RolloutManager).remote(cfg, log_dir=log_dir)
