"""Where the job's actors run: Ray placement groups for the trainer ranks and for the SGLang engines.

On a cluster whose Ray nodes offer GPUs, each trainer rank holds 1 GPU and each engine `rollout.engine.
tensor_parallel` GPUs (Ray sets the actor's CUDA_VISIBLE_DEVICES, which the engine process inherits). Both are
PACKed onto as few nodes as possible. The trainer's ranks (colocated: its GPUs, each shared with an engine) are
reserved a tensor-parallel group at a time (and an expert-parallel group where a node holds one:
`trainer_group_size`), each group a STRICT_PACK placement group on one node (`reserve_grouped`), and numbered node
by node, so the consecutive ranks Megatron puts in one such group share a node whatever the nodes have free. An
engine spanning nodes (`rollout.engine.nodes_per_engine`) has a group of its own, one bundle per node part,
STRICT_SPREAD over distinct nodes. Without GPUs each bundle holds a sliver of CPU (Ray bundles cannot be empty; the
real CPU use is not Ray's to schedule on a small machine), so the code path is the same on a laptop, in CI and on a
GPU cluster: only the resources asked for differ.

Colocated (`placement.colocate`): one bundle per GPU, reserved as the trainer's ranks are; trainer rank i and engine
i (one GPU each) hold half of bundle i each, so Ray gives both the same GPU (and sets the same CUDA_VISIBLE_DEVICES).
Without GPUs the bundle's CPU sliver is halved the same way. With expert parallelism and the tensor transport, GPUs
on more than one node are refused in one line (`colocated_sender_problem`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from slimish.cuda_facts import collect as collect_cuda_facts
from slimish.cuda_facts import problem as cuda_problem
from slimish.errors import UserError

CPU_SLIVER = 0.01  # a bundle's resource when the cluster has no GPUs (the default of ray.cpus_per_slot)
COLOCATED_SHARE = 0.5  # of a colocated bundle, for each of the two actors on it (a trainer rank and an engine)


class PlacementError(RuntimeError):
    pass


@dataclass(frozen=True)
class Slot:
    """One reserved bundle: where an actor goes and the GPUs (or, without GPUs, the CPUs) it holds."""

    group: PlacementGroup
    bundle: int
    node_id: str
    gpus: float  # whole GPUs, or a share of one (colocated)
    cpus: float = 0.0

    def actor_options(self) -> dict:
        return {"num_cpus": self.cpus, "num_gpus": self.gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=self.bundle)}


def cluster_gpus() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


def reserve(name: str, *, count: int, gpus_each: int, timeout_s: float, cpus_each: float = CPU_SLIVER) -> list[Slot]:
    """`count` bundles of `gpus_each` GPUs each (`cpus_each` CPUs without GPUs), PACKed, ordered node by node."""
    if count == 0:  # attached engines: nothing to place
        return []
    bundle = {"GPU": gpus_each} if gpus_each else {"CPU": cpus_each}
    group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK", name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(
            f"could not reserve {count} x {bundle} for the {name} within {timeout_s:.0f}s; the Ray cluster has "
            f"{ray.cluster_resources()} in all and {ray.available_resources()} free")
    nodes = placement_group_table(group)["bundles_to_node_id"]
    order = sorted(range(count), key=lambda i: (nodes[i], i))
    return [Slot(group, i, nodes[i], gpus_each, 0.0 if gpus_each else cpus_each) for i in order]


def trainer_group_size(*, tensor_parallel: int, expert_parallel: int, node_gpus: int,
                       expert_tensor_parallel: int = 0) -> int:
    """How many consecutive trainer ranks must share a node: a tensor-parallel group always (Megatron's ranks are
    ordered tensor-parallel first: ranks [k * tp, (k + 1) * tp) are one group), and an expert-tensor-parallel group
    (`expert_tensor_parallel`, 0: tp; [k * etp, (k + 1) * etp)) too, and the block of etp x ep ranks that holds
    whole expert-parallel groups when one node has the GPUs for it (ep groups over several nodes are the rule for
    large MoE models; then only the tp and etp groups are kept whole). `node_gpus`: the largest node's GPUs (0:
    none)."""
    etp = expert_tensor_parallel or tensor_parallel
    whole = math.lcm(tensor_parallel, etp)
    block = math.lcm(whole, etp * expert_parallel)
    if expert_parallel > 1 and (node_gpus == 0 or block <= node_gpus):
        return block
    return whole


def largest_node_gpus() -> int:
    """The GPUs of the Ray cluster's largest live node (0 without GPUs)."""
    return max((int(node.get("Resources", {}).get("GPU", 0)) for node in ray.nodes() if node.get("Alive")), default=0)


def reserve_grouped(name: str, *, count: int, group_size: int, gpus_each: int, timeout_s: float,
                    cpus_each: float = CPU_SLIVER) -> list[Slot]:
    """Like `reserve` (`count` bundles, numbered node by node), such that bundles [k * group_size, (k + 1) *
    group_size) are on one node: each group is a STRICT_PACK placement group of its own. One PACKed group of
    single-GPU bundles, as `reserve` makes, lets PACK fill nodes unevenly and put a group across two (ranks 0-2 on a
    node with 3 free GPUs, 3 on the next: the tensor-parallel group {2, 3} over the network). A group larger than
    any node's GPUs is a UserError in one line; a group Ray cannot place in time, a PlacementError."""
    if group_size == 1:
        return reserve(name, count=count, gpus_each=gpus_each, timeout_s=timeout_s, cpus_each=cpus_each)
    if count % group_size:
        raise UserError(f"parallel.num_trainer_ranks is {count}, which is not a multiple of the {group_size} ranks "
                        "that must share a node (tensor_parallel, times expert_parallel where a node holds them)")
    if gpus_each and group_size * gpus_each > (largest := largest_node_gpus()):
        raise UserError(f"parallel.tensor_parallel (x expert_parallel) puts {group_size} trainer ranks in a group that "
                        f"must share a node, but the Ray cluster's largest node has {largest} GPUs: lower it, or use "
                        "nodes with more GPUs")
    bundle = {"GPU": gpus_each} if gpus_each else {"CPU": cpus_each}
    groups = _placement_groups(count // group_size, bundle, group_size, strategy="STRICT_PACK",
                               name=lambda k: f"{name}-{k}", timeout_s=timeout_s,
                               what=lambda k: f"on one node for the {name} (group {k})")
    placed = [[Slot(group, i, nodes[i], gpus_each, 0.0 if gpus_each else cpus_each) for i in range(group_size)]
              for group, nodes in groups]
    placed.sort(key=lambda slots: slots[0].node_id)  # stable: groups keep their order within a node
    return [slot for slots in placed for slot in slots]


def _placement_groups(count: int, bundle: dict, size: int, *, strategy: str, name, timeout_s: float,
                      what) -> list[tuple[PlacementGroup, list[str]]]:
    """`count` placement groups of `size` x `bundle` each under `strategy` (group k named `name(k)`), each ready
    within `timeout_s`, with the node of each of its bundles; a PlacementError naming group k (`what(k)`: where
    and for what it was asked) when one is not, and none of them kept."""
    groups: list[PlacementGroup] = []
    try:
        for k in range(count):
            groups.append(placement_group([dict(bundle) for _ in range(size)], strategy=strategy, name=name(k)))
            ready, _ = ray.wait([groups[-1].ready()], timeout=timeout_s)
            if not ready:
                raise PlacementError(
                    f"could not reserve {size} x {bundle} {what(k)} within {timeout_s:.0f}s; the Ray cluster has "
                    f"{ray.cluster_resources()} in all and {ray.available_resources()} free")
    except BaseException:
        for group in groups:
            remove_placement_group(group)
        raise
    return [(group, placement_group_table(group)["bundles_to_node_id"]) for group in groups]


def colocated_sender_problem(bundles: list[Slot], *, transport: str, expert_parallel: int) -> str | None:
    """Why a colocated job on these bundles could not sync, or None. With the tensor transport each data-parallel
    replica's first rank sends to the engines on its own GPUs by CUDA IPC; with expert parallelism the export spans
    replicas, so trainer rank 0 sends to every engine, and CUDA IPC reaches only its own node's."""
    nodes = {slot.node_id for slot in bundles}
    if transport != "tensor" or expert_parallel == 1 or len(nodes) == 1:
        return None
    return (f"placement.colocate with parallel.expert_parallel={expert_parallel} and weight_sync.transport=tensor "
            f"needs every GPU on one node (trainer rank 0 sends every engine its weights by CUDA IPC), but the job's "
            f"{len(bundles)} GPUs are on {len(nodes)} nodes: use weight_sync.transport=disk (on storage every node "
            "reads), or fewer ranks")


def reserve_engines(*, count: int, nodes_per_engine: int, gpus_each: int, timeout_s: float,
                    cpus_each: float = CPU_SLIVER) -> list[list[Slot]]:
    """Slots of `count` engines, engine i's node parts in order (`gpus_each` GPUs per engine, split evenly over its
    parts). Engines of one node each share one PACKed group (`reserve`); an engine spanning nodes gets a group of
    its own, STRICT_SPREAD: each part on a node no other part of it holds (a UserError in one line when the cluster
    has fewer nodes)."""
    if nodes_per_engine == 1:
        return [[slot] for slot in reserve("slimish-engines", count=count, gpus_each=gpus_each, timeout_s=timeout_s,
                                           cpus_each=cpus_each)]
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    if count and alive < nodes_per_engine:
        raise UserError(f"rollout.engine.nodes_per_engine is {nodes_per_engine}, but the Ray cluster has {alive} "
                        f"node(s): run the job on at least {nodes_per_engine} nodes (sbatch -N), or lower it")
    part_gpus = gpus_each // nodes_per_engine
    bundle = {"GPU": part_gpus} if part_gpus else {"CPU": cpus_each}
    groups = _placement_groups(count, bundle, nodes_per_engine, strategy="STRICT_SPREAD",
                               name=lambda i: f"slimish-engine{i}", timeout_s=timeout_s,
                               what=lambda i: f"on {nodes_per_engine} distinct nodes for engine {i}")
    return [[Slot(group, r, where[r], part_gpus, 0.0 if part_gpus else cpus_each) for r in range(nodes_per_engine)]
            for group, where in groups]


class GpuUnusable(UserError):
    """Ray gave a slot GPUs that the process running there cannot use (see `slimish.cuda_facts`)."""


def check_gpus(slots: dict) -> None:
    """Raise `GpuUnusable` (one line: the first slot's cause, and how many more) unless every GPU slot can use its
    GPUs. Each slot is probed by a short task that holds its bundle, so it sees the CUDA_VISIBLE_DEVICES its actor
    will; the task's worker exits after it (max_calls=1), keeping no CUDA state."""
    probe = ray.remote(max_calls=1)(collect_cuda_facts)
    holders = {f"trainer rank {i}": slot for i, slot in enumerate(slots["trainer"]) if slot.gpus}
    holders.update({f"engine {i}" + (f" part {r}" if len(parts) > 1 else ""): slot
                    for i, parts in enumerate(slots["engines"]) for r, slot in enumerate(parts) if slot.gpus})
    facts = ray.get([probe.options(**slot.actor_options()).remote() for slot in holders.values()])
    names = node_names()
    problems = [line for (holder, slot), fact in zip(holders.items(), facts, strict=True)
                if (line := cuda_problem(fact, gpus=math.ceil(slot.gpus), holder=holder,
                                         node=names.get(slot.node_id)))]
    if problems:
        more = f" (and {len(problems) - 1} more slots cannot either)" if len(problems) > 1 else ""
        raise GpuUnusable(problems[0] + more)


def colocated(bundles: list[Slot]) -> dict:
    """Trainer rank i and engine i on bundle i (one GPU, or a CPU sliver), each holding `COLOCATED_SHARE` of it."""
    shares = [replace(slot, gpus=slot.gpus * COLOCATED_SHARE, cpus=slot.cpus * COLOCATED_SHARE) for slot in bundles]
    return {"trainer": shares, "engines": [[share] for share in shares]}


def release(slots: list[Slot]) -> None:
    for group in {slot.group for slot in slots}:
        try:
            remove_placement_group(group)
        except Exception:  # Ray may already be shutting down
            pass


def on_this_node() -> dict:
    """Actor options that pin an actor to the driver's node: the rollout manager, whose router listens on loopback
    and whose logs and process ids are then the head node's."""
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
        node_id=ray.get_runtime_context().get_node_id(), soft=False)}


def node_names() -> dict[str, str]:
    """Ray node id -> the node's name (Slurm's node name under launch/train.sbatch), else its address."""
    return {node["NodeID"]: node.get("NodeName") or node.get("NodeManagerAddress") for node in ray.nodes()}


def placement_record(slots: dict, engines: list[dict], router_url: str) -> dict:
    """What ran where (placement.json in the run directory): the node of every trainer rank and engine, with the
    GPUs Ray gave each engine (attached engines: their URLs); an engine spanning nodes: its first part's node,
    GPUs and URL, and each part's under "parts" (a part beyond the first serves only SGLang's stand-in health); the
    router's URL (its port is picked at the start unless rollout.router.port sets it)."""
    names = node_names()

    def part(slot: Slot, info: dict) -> dict:
        return {"node": names.get(slot.node_id, slot.node_id), "gpus": slot.gpus,
                "cuda_visible_devices": info["cuda_visible_devices"], "url": info["url"]}

    if slots["engines"]:
        placed = [{"index": i, **part(parts[0], engine),
                   **({"parts": [part(slot, info) for slot, info in zip(parts, engine["parts"], strict=True)]}
                      if len(parts) > 1 else {})}
                  for i, (parts, engine) in enumerate(zip(slots["engines"], engines, strict=True))]
    else:  # attached engines ran before the job: it placed none
        placed = [{"index": i, "url": engine["url"], "attached": True} for i, engine in enumerate(engines)]
    return {"gpus": cluster_gpus(),
            "trainer": [{"rank": rank, "node": names.get(slot.node_id, slot.node_id), "gpus": slot.gpus}
                        for rank, slot in enumerate(slots["trainer"])],
            "engines": placed, "router": {"url": router_url}}
