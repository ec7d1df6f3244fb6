"""Ray setup and the actor groups of a job.

Local runs start a private Ray on loopback only; with RAY_ADDRESS set (e.g. by launch/train.sbatch) the driver
joins that cluster instead. Trainer ranks and engines run in placement slots (`placement.py`): GPUs where the
cluster has them, else a sliver of CPU each: the engines' and trainers' real CPU use is not Ray's to schedule, and on
a 2-core machine whole-CPU reservations would only deadlock placement.
"""

from __future__ import annotations

import os

import ray  # (slimish/orchestration/__init__.py keeps a local Ray on loopback)

from slimish import log
from slimish.config.schema import JobConfig
from slimish.errors import UserError
from slimish.network import interface_of
from slimish.orchestration.placement import (
    Slot,
    check_gpus,
    cluster_gpus,
    colocated,
    colocated_sender_problem,
    largest_node_gpus,
    on_this_node,
    release,
    reserve_engines,
    reserve_grouped,
    trainer_group_size,
)

TRAINER_SHUTDOWN_S = 5.0  # a trainer rank's own shutdown, before it is killed either way


def init_ray(cfg: JobConfig) -> None:
    env = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", log.LEVEL_ENV: cfg.run.log_level}
    # Every worker process of the job logs as the driver does (slimish/log.py).
    runtime_env = {"env_vars": env, "worker_process_setup_hook": "slimish.log.setup_worker"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True, runtime_env=runtime_env)
        return
    # gloo and NCCL pick their interface from the hostname unless told: on one host, loopback (the job's listeners
    # bind the node's Ray address, see slimish/network.py). launch/train.sbatch sets them from SLIMISH_NET_IFNAME.
    loopback = interface_of("127.0.0.1") or "lo"
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env[name] = os.environ.get(name, loopback)
    ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=True, runtime_env=runtime_env)


class TrainerGroup:
    """All trainer ranks, rank r in placement slot r; every method call is sent to every rank (SPMD) and rank 0's
    result is returned.

    The ranks run their calls one at a time, in order, except `release_sync`, which runs on a thread of its own
    (Ray's concurrency group "control") while the rank is inside `sync_weights`: that is what lets a sync blocked on
    an engine go."""

    def __init__(self, actors: list):
        """A group of started rank actors (`launch` starts a job's)."""
        self.actors = actors
        self.calls = 0  # calls made to the ranks (each to every rank), for the driver's trainer_calls metric

    @classmethod
    def launch(cls, cfg: JobConfig, slots: list[Slot]) -> TrainerGroup:
        """The job's `TrainerWorker` actors, rank r in `slots[r]`."""
        from slimish.trainer.worker import TrainerWorker

        actor_cls = ray.remote(concurrency_groups={"control": 1})(TrainerWorker)
        world = cfg.parallel.num_trainer_ranks
        return cls([actor_cls.options(**slot.actor_options()).remote(cfg, rank=rank, world_size=world)
                    for rank, slot in enumerate(slots)])

    def pop_calls(self) -> int:
        """The calls made since the last `pop_calls`."""
        calls, self.calls = self.calls, 0
        return calls

    def call(self, method: str, *args, **kwargs):
        return self.call_all(method, *args, **kwargs)[0]

    def call_all(self, method: str, *args, **kwargs) -> list:
        """Every rank's result, in rank order."""
        return ray.get(self.submit(method, *args, **kwargs))

    def submit(self, method: str, *args, **kwargs) -> list:
        """Start `method` on every rank; their results to come (Ray object refs), in rank order. With several ranks
        the arguments go to Ray's object store once and every rank reads them there: passed as they are, a step's
        samples would be pickled once per rank (112 times a call for the 405B recipe's layout)."""
        self.calls += 1
        if len(self.actors) > 1:
            args = tuple(ray.put(arg) for arg in args)
            kwargs = {key: ray.put(value) for key, value in kwargs.items()}
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def release_sync(self, reason: str) -> None:
        """`TrainerWorker.release_sync` on every rank, beside the `sync_weights` they are in."""
        ray.get([a.release_sync.options(concurrency_group="control").remote(reason) for a in self.actors])

    def setup(self) -> dict:
        """Every rank's `TrainerWorker.setup`: rank 0's answer, with every rank's GPUs, weight sender and initial
        weights' read (`InitialWeights.report`) by rank."""
        master_addr, master_port = ray.get(self.actors[0].address.remote())
        ranks = self.call_all("setup", master_addr=master_addr, master_port=master_port)
        return {**ranks[0], "trainer_master_addr": master_addr, "rank_gpus": [r["gpus"] for r in ranks],
                "weight_senders": [r["weight_sender"] for r in ranks],
                "weights_read": [r["weights_read"] for r in ranks]}

    def kill(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=TRAINER_SHUTDOWN_S)
            except Exception:  # a dead or hung actor: ray.kill below ends it either way
                pass
            ray.kill(actor)


def rollout_actor(cfg: JobConfig, log_dir: str, engine_slots: list[list[Slot]], api_key: str | None,
                  progress_bar: bool = False):
    """The rollout manager, on the driver's node; its engines go to `engine_slots` (engine i's node parts) and
    require `api_key`; `progress_bar`: it draws one on the driver's terminal."""
    from slimish.rollout.manager import ConfiguredRolloutManager

    return ray.remote(ConfiguredRolloutManager).options(**on_this_node()).remote(
        cfg, log_dir=log_dir, engine_options=[[slot.actor_options() for slot in parts] for parts in engine_slots],
        api_key=api_key, progress_bar=progress_bar)


def reserve_slots(cfg: JobConfig) -> dict:
    """Placement slots for the trainer ranks and the engines: GPUs when the Ray cluster has them (each checked to be
    usable there, else `GpuUnusable`), else `ray.cpus_per_slot` CPUs each; shared by trainer rank i and engine i
    with placement.colocate (`placement.colocated`)."""
    gpus = cluster_gpus() > 0
    timeout, cpus = cfg.ray.placement_timeout_s, cfg.ray.cpus_per_slot
    layout = cfg.parallel
    group_size = trainer_group_size(tensor_parallel=layout.tensor_parallel, expert_parallel=layout.expert_parallel,
                                    expert_tensor_parallel=layout.expert_tensor_parallel,
                                    node_gpus=largest_node_gpus() if gpus else 0)
    if cfg.placement.colocate:
        bundles = reserve_grouped("slimish-colocated", count=layout.num_trainer_ranks, group_size=group_size,
                                  gpus_each=int(gpus), timeout_s=timeout, cpus_each=cpus)
        try:
            problem = colocated_sender_problem(bundles, transport=cfg.weight_sync.transport,
                                               expert_parallel=cfg.parallel.expert_parallel)
            if problem:
                raise UserError(problem)
            slots = colocated(bundles)
            if gpus:
                check_gpus(slots)
        except BaseException:
            release(bundles)
            raise
        return slots
    trainer = reserve_grouped("slimish-trainer", count=layout.num_trainer_ranks, group_size=group_size,
                              gpus_each=int(gpus), timeout_s=timeout, cpus_each=cpus)
    engine = cfg.rollout.engine
    engines: list[list[Slot]] = []
    try:
        engines = reserve_engines(count=0 if engine.attach else engine.num_engines,
                                  nodes_per_engine=engine.nodes_per_engine,
                                  gpus_each=engine.tensor_parallel if gpus else 0, timeout_s=timeout, cpus_each=cpus)
        slots = {"trainer": trainer, "engines": engines}
        if gpus:
            check_gpus(slots)
    except BaseException:
        release(trainer + [slot for parts in engines for slot in parts])
        raise
    return slots
