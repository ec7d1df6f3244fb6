"""Sync time on paper: what each transport would take for a model on a stated cluster, from the bytes each link
carries and its bandwidth (for `slimish plan` and the scale tables of docs/weight-sync.md; none has run on a GPU).

The model is the wire only: control calls, export gathers and the engines' copy into their parameters come on top
(measured on CPU in bench/weight_sync.py, where they dominate; on GPU they overlap with the wire, see broadcast.py).

  broadcast  full: every engine rank receives every byte (SGLang's /update_weights_from_distributed hands full
             tensors to each tensor-parallel rank), one bucket at a time (an engine serves one update request at a
             time): an NCCL broadcast pipelines a bucket to all receivers, so a sync takes model bytes / NIC
             bandwidth, whatever the number of engines, and whatever the number of senders: stage senders
             (slimish.weight_sync.stages) take turns on the wire. Without them (`stage_senders=False`) trainer rank 0
             first takes in the later pipeline stages' share of the model, on the thread that sends (counted here as
             not overlapped).
             Sharded from one sender (`engine_shards` = the engines' tensor-parallel size t, `route` None): engine
             rank r of every engine receives only its shard, over a group of its own (group r: the sender and rank r
             of each engine), the t groups at once. Their sender is one trainer rank, so the assumption here is its
             one NIC: the t groups share it, and the sync takes every rank's payload (the model, plus t - 1 more
             copies of what SGLang replicates) / NIC bandwidth, no less than full.
             Sharded from several senders (`route` "stages" or "owned", as `WeightSender._senders_route` picks it;
             `several_senders` says who sends what): every sender broadcasts its own bytes over per-rank groups of its
             own, and each round rank 0 asks every engine for the next bucket of every ready sender at once, each
             engine rank receiving its part from all of them concurrently. A round then takes the longer of the
             busiest sender's bucket over its NIC and one engine rank's parts over its own; the rounds add up to
             max(busiest sender's bytes, one engine rank's payload) / NIC bandwidth. Assumed: one NIC per GPU (NCCL
             gives a rank's communicators the NIC nearest its GPU), every sender on a GPU of its own, buckets of about
             one size (the senders stay busy in every round), and the senders' export gathers within a node
             (NVLink, not counted).
  disk       the sender writes every byte to a shared filesystem, then every engine reads it all: bytes / write
             bandwidth + bytes / (read bandwidth per engine), engines reading in parallel. Sharded (`engine_shards`):
             each engine rank reads only its own files, 1 / t of the bytes, the ranks in parallel at the read
             bandwidth each; the one writer writes every rank's payload, or, from several senders, each sender writes
             its own bytes at the write bandwidth, the senders in parallel (the busiest one's seconds).
  experts    with expert parallelism E in the trainer (`expert_bytes`, `expert_parallel`), every expert reaches its
             stage's leader before it is sent: the experts of expert-parallel ranks 1..E-1 travel to rank 0 one
             tensor at a time on the thread that sends (`full_export._stage_tensors`); those from other nodes
             (`expert_funnel_bytes`) cross the leader's NIC, counted as not overlapped, on both transports. On the
             "stages" route the same holds per stage: each stage's experts cross to that stage's leader (its own
             NIC, the stages in parallel). On the "owned" route no expert moves before it is sent: each
             expert-parallel rank's owner sends its own.

What SGLang replicates on every engine rank (norms, routers) is counted when given as `replicated_bytes`; `plan`
gives 0: under 0.1% of a large model (from several senders it is counted on the stages' leaders, in proportion to
their parts outside the experts). `tensor` (one node, memory handles) has no wire.

`cpu_sync_seconds` models the other end: one CPU node, where a sync is copies, checksums, a loopback broadcast,
page-cache files and engine requests (`Machine`, rates the bench measures in the same run), for the bytes a sync
really moves (`payload`: per engine rank its shard plus what SGLang replicates when sharded, the whole model when
not; the sender's total), counted as CPU-seconds over the cores the sync gets as well as step by step, the sender's
hashing thread sharing the cores with the path beside it as the scheduler shares them (its tail after the path is
the sync's: the engines' checksums wait for it).
bench/weight_sync.py --engine-tp 2 checks it against measured syncs (docs/weight-sync.md, "Calibration on the
CPU").
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Cluster:
    nic_gbit_s: float = 400.0        # per GPU (H100/H200 nodes: one 400 Gb/s NIC per GPU)
    fs_write_gbyte_s: float = 10.0   # one writer to a parallel filesystem
    fs_read_gbyte_s: float = 10.0    # one engine reading from it
    gpus_per_node: int = 8           # NVLink within a node: expert hops there are not counted (an order faster)


ROUTES = ("stages", "owned")


@dataclass(frozen=True, kw_only=True)
class StageBytes:
    """One pipeline stage's share of the model: `dense` outside the routed experts (embedding, attention, norms,
    dense and shared MLPs, routers, output layer), `experts` its routed experts."""
    dense: float
    experts: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Sender:
    """One trainer rank sending on a several-senders route: `role` "leader" (a pipeline stage's leader) or "owner"
    (an expert-parallel rank's owner of its experts), `stage` its pipeline stage, `out_bytes` what it sends (every
    engine rank's part of what it holds, over its own NIC or written by it), `in_bytes` what reaches it from other
    nodes before it sends (the "stages" route's experts, `expert_funnel_bytes`)."""
    role: str
    stage: int
    out_bytes: float
    in_bytes: float = 0.0


def even_stages(model_bytes: float, *, pipeline_parallel: int, expert_bytes: float = 0.0) -> list[StageBytes]:
    """The model split evenly over `pipeline_parallel` stages (where the caller has no per-stage counts)."""
    pp = max(1, pipeline_parallel)
    return [StageBytes(dense=(model_bytes - expert_bytes) / pp, experts=expert_bytes / pp)] * pp


def several_senders(route: str, stages: list[StageBytes], *, expert_parallel: int = 1,
                    expert_tensor_parallel: int = 1, engine_shards: int = 1, replicated_bytes: float = 0.0,
                    cluster: Cluster = Cluster()) -> list[Sender]:
    """Who sends what on the sharded route's several senders (`WeightSender._senders_route`):

    - "stages": each stage's leader its whole stage (`export_stage_hf_tensors`), the stage's experts of other nodes
      reaching it first over its NIC (`expert_funnel_bytes` of the stage's experts);
    - "owned": each stage's leader its stage outside the experts and its own expert-parallel rank's experts, and the
      owner of each other expert-parallel rank of the stage its own experts (`export_owned_hf_tensors`): pipeline
      stages x `expert_parallel` senders, nothing funnelled.

    What SGLang replicates (`replicated_bytes`, whole on each of `engine_shards` engine ranks) goes t times, from the
    leaders, shared out in proportion to their parts outside the experts."""
    if route not in ROUTES:
        raise ValueError(f"no several-senders route {route!r}; known: {', '.join(map(repr, ROUTES))}")
    dense = sum(stage.dense for stage in stages) or 1.0
    extra = replicated_bytes * (max(1, engine_shards) - 1)
    senders = []
    for s, stage in enumerate(stages):
        leader = stage.dense + extra * stage.dense / dense
        if route == "stages":
            funnel = expert_funnel_bytes(stage.experts, expert_parallel=expert_parallel,
                                         expert_tensor_parallel=expert_tensor_parallel, cluster=cluster)
            senders.append(Sender(role="leader", stage=s, out_bytes=leader + stage.experts, in_bytes=funnel))
            continue
        own = stage.experts / max(1, expert_parallel)
        senders.append(Sender(role="leader", stage=s, out_bytes=leader + own))
        senders += [Sender(role="owner", stage=s, out_bytes=own) for _ in range(max(1, expert_parallel) - 1)]
    return senders


def sync_seconds(model_bytes: float, *, transport: str, cluster: Cluster = Cluster(), pipeline_parallel: int = 1,
                 stage_senders: bool = True, engine_shards: int = 1, replicated_bytes: float = 0.0,
                 expert_bytes: float = 0.0, expert_parallel: int = 1, expert_tensor_parallel: int = 1,
                 route: str | None = None, stages: list[StageBytes] | None = None) -> float:
    """Seconds on the wire to move `model_bytes` to every engine with `transport` (see the module docstring);
    `engine_shards` > 1: the sharded sync to engines of that many tensor-parallel ranks, of which every rank holds
    `replicated_bytes` whole (`payload`; 0, as `slimish plan` passes it, is the 1/t split); `expert_bytes` of the
    model are routed experts, spread over `expert_parallel` trainer ranks (each expert split over
    `expert_tensor_parallel`). `route` ("stages" or "owned", with `engine_shards` > 1): the sharded sync from
    several senders (`several_senders`), `stages` each pipeline stage's bytes (None: `even_stages` of
    `pipeline_parallel`); None: one sender (rank 0, or broadcast's whole-stage senders taking turns)."""
    if transport not in ("broadcast", "disk"):
        raise ValueError(f"no estimate for transport {transport!r}; known: 'broadcast', 'disk'")
    link = cluster.nic_gbit_s / 8 * GB
    load = payload(model_bytes, engine_tp=engine_shards, sharded=engine_shards > 1, replicated_bytes=replicated_bytes)
    if route is not None and engine_shards > 1:
        stages = stages or even_stages(model_bytes, pipeline_parallel=pipeline_parallel, expert_bytes=expert_bytes)
        senders = several_senders(route, stages, expert_parallel=expert_parallel,
                                  expert_tensor_parallel=expert_tensor_parallel, engine_shards=engine_shards,
                                  replicated_bytes=replicated_bytes, cluster=cluster)
        if transport == "broadcast":
            return max(max((s.out_bytes + s.in_bytes) / link for s in senders), load.rank_bytes / link)
        write = cluster.fs_write_gbyte_s * GB
        return max(s.out_bytes / write + s.in_bytes / link for s in senders) \
            + load.rank_bytes / (cluster.fs_read_gbyte_s * GB)
    experts = expert_funnel_bytes(expert_bytes, expert_parallel=expert_parallel,
                                  expert_tensor_parallel=expert_tensor_parallel, cluster=cluster) / link
    if transport == "broadcast":
        funnel = 0.0 if stage_senders else model_bytes * (pipeline_parallel - 1) / pipeline_parallel / link
        return load.sender_bytes / link + funnel + experts
    return load.sender_bytes / (cluster.fs_write_gbyte_s * GB) + load.rank_bytes / (cluster.fs_read_gbyte_s * GB) \
        + experts


def expert_funnel_bytes(expert_bytes: float, *, expert_parallel: int, expert_tensor_parallel: int = 1,
                        cluster: Cluster = Cluster()) -> float:
    """Of `expert_bytes`, those that reach their stage's leader (expert-parallel rank 0) from another node before
    they are sent: Megatron numbers an expert group's ranks expert-tensor-parallel first, so
    gpus_per_node / expert_tensor_parallel expert-parallel ranks share rank 0's node (their hops, over NVLink, are
    not counted) and the others' share crosses the leader's NIC."""
    on_node = max(1, cluster.gpus_per_node // max(1, expert_tensor_parallel))
    off_node = max(0, expert_parallel - on_node)
    return expert_bytes * off_node / expert_parallel


# ---------------------------------------------------------------------------------------------- the CPU, calibrated
# On one CPU node (bench/weight_sync.py --engine-tp 2) there is no wire worth the name: a sync is memory copies,
# SHA-256 checksums, a gloo broadcast over loopback and page-cache file I/O, the sender's threads and the engine's
# tensor-parallel ranks all on the same few cores. The terms below are measured by the bench in the same run, never
# fitted per case.


@dataclass(frozen=True, kw_only=True)
class Machine:
    """One node's measured rates, GB/s (1e9 bytes), each of one thread alone: `copy_gbyte_s` a tensor copy into a
    reused buffer (the sender's flatten, an engine's copy into its parameters), `hash_gbyte_s` SGLang's CPU checksum
    (SHA-256), `link_gbyte_s` bytes leaving a gloo broadcast's sender per second (a broadcast of n bytes to k
    receivers puts out k x n), `fs_write_gbyte_s` writing a file in the disk transport's directory (seconds: it
    waits on I/O too) and `fs_write_cpu_gbyte_s` the CPU-seconds of writing and removing it (0: as a copy),
    `fs_read_gbyte_s` copying a file there out of a fresh mapping of it (safetensors' loaders map the files),
    `mapped_gbyte_s` copying out of a fresh mapping of a shared-memory segment (an engine reading the tensor
    transport's bucket: every page is faulted in once), `fresh_gbyte_s` copying into a newly allocated buffer (an
    engine's receive buffer, allocated per bucket: every page is faulted in and zeroed once); 0: as `copy_gbyte_s`.
    `link_busy_cores`: CPUs a raw gloo broadcast keeps busy while it runs (sender and receivers, their CPU-seconds
    over its seconds); `request_s` one engine request's seconds besides its bytes (HTTP, pickling, SGLang's
    tokenizer manager, scheduler and tensor-parallel workers) and `request_cpu_s` the CPU-seconds it costs all of
    them; `cores` the CPUs the sync's threads and processes share."""
    copy_gbyte_s: float
    hash_gbyte_s: float
    link_gbyte_s: float
    fs_write_gbyte_s: float
    fs_read_gbyte_s: float
    fs_write_cpu_gbyte_s: float = 0.0
    mapped_gbyte_s: float = 0.0
    fresh_gbyte_s: float = 0.0
    link_busy_cores: float = 1.0
    request_s: float = 0.0
    request_cpu_s: float = 0.0
    cores: float = 1.0


# Engine requests per sync besides one per bucket: /begin_weight_update, /end_weight_update, /weights_checker and
# /model_info (the version).
SYNC_REQUESTS = 4


@dataclass(frozen=True, kw_only=True)
class Payload:
    """The bytes of one sync to one engine of `engine_tp` ranks. `rank_bytes`: what each engine rank receives;
    `sender_bytes`: what the sender stages (written, flattened) in all; `held_bytes`: what each rank holds (copied
    into its parameters, then checksummed); `link_bytes`: what leaves the sender on a broadcast; `assembled_bytes`:
    the fused parameters the sharded sender builds whole before cutting them (a second copy); `strided_bytes`: what
    the sender hashes from strided views (a row-parallel weight's column slice), which its hashing thread first
    copies into a fresh contiguous tensor (`checksums._Sha.update`: SHA-256 reads contiguous bytes)."""
    engine_tp: int
    rank_bytes: float
    sender_bytes: float
    held_bytes: float
    link_bytes: float
    assembled_bytes: float
    strided_bytes: float = 0.0


def payload(model_bytes: float, *, engine_tp: int, sharded: bool, replicated_bytes: float = 0.0,
            fused_bytes: float = 0.0, strided_bytes: float = 0.0) -> Payload:
    """What a sync moves: full, every rank receives `model_bytes` and keeps its shard plus what SGLang replicates
    (`replicated_bytes`, norms: every rank holds them whole), the sender stages the model once and a broadcast puts
    it out once per rank; sharded, each rank receives exactly what it holds and the sender stages every rank's
    payload (the model plus t - 1 more copies of the replicated tensors), assembling each fused parameter
    (`fused_bytes`: q/k/v, gate/up) whole first. `strided_bytes`: of the model, the tensors each rank gets a strided
    slice of (row-parallel: split along a later dimension), on both routes hashed from those slices."""
    held = (model_bytes - replicated_bytes) / engine_tp + replicated_bytes
    if sharded:
        return Payload(engine_tp=engine_tp, rank_bytes=held, sender_bytes=held * engine_tp, held_bytes=held,
                       link_bytes=held * engine_tp, assembled_bytes=fused_bytes, strided_bytes=strided_bytes)
    return Payload(engine_tp=engine_tp, rank_bytes=model_bytes, sender_bytes=model_bytes, held_bytes=held,
                   link_bytes=model_bytes * engine_tp, assembled_bytes=0.0, strided_bytes=strided_bytes)


# The terms on the engine's side: seconds of one engine rank (its tensor-parallel peers do the same at once).
ENGINE_TERMS = ("receive", "read", "load", "verify")


# The hashing thread's steps (beside the sender's path) and the engines' checksums (after it).
HASH_TERMS = ("hash", "contiguous")


def cpu_sync_terms(load: Payload, *, transport: str, machine: Machine, buckets: int = 0) -> dict[str, float]:
    """Seconds of each step of one sync on `machine`, each as one thread alone would take it (`cpu_sync_seconds`
    says how they add up). The sender's: `requests` (one engine request per bucket, `buckets`, and `SYNC_REQUESTS`
    more), `assemble` (the fused parameters the sharded sender builds whole), `stage` (flatten, or write the files),
    `wire` (broadcast: the bytes it puts out); on its hashing thread (`HASH_TERMS`): `hash` (its checksums) and
    `contiguous` (the strided slices it copies into fresh tensors first, `Payload.strided_bytes`). Each engine
    rank's (`ENGINE_TERMS`): `receive` (broadcast: its fresh receive buffer's pages, beyond the copy the wire makes),
    `read` (disk: its files out of their mapping), `load` (the copy into its parameters: from the tensor
    transport's freshly mapped segment, else from memory it already touched), `verify` (its checksums)."""
    copy, gb = machine.copy_gbyte_s * GB, GB
    mapped = (machine.mapped_gbyte_s or machine.copy_gbyte_s) * GB
    fresh = (machine.fresh_gbyte_s or machine.copy_gbyte_s) * GB
    terms = {"requests": (buckets + SYNC_REQUESTS) * machine.request_s, "assemble": load.assembled_bytes / copy}
    if transport == "tensor":
        terms["stage"] = load.sender_bytes / copy
        terms["load"] = load.held_bytes / mapped
    elif transport == "broadcast":
        terms["stage"] = load.sender_bytes / copy
        terms["wire"] = load.link_bytes / (machine.link_gbyte_s * gb)
        terms["receive"] = max(0.0, load.rank_bytes / fresh - load.rank_bytes / copy)
        terms["load"] = load.held_bytes / copy
    elif transport == "disk":
        terms["stage"] = load.sender_bytes / (machine.fs_write_gbyte_s * gb)
        terms["read"] = load.rank_bytes / (machine.fs_read_gbyte_s * gb)
        terms["load"] = load.held_bytes / copy
    else:
        raise ValueError(f"no estimate for transport {transport!r}; known: 'broadcast', 'disk', 'tensor'")
    terms["hash"] = load.sender_bytes / (machine.hash_gbyte_s * gb)
    terms["contiguous"] = load.strided_bytes / fresh
    terms["verify"] = load.held_bytes / (machine.hash_gbyte_s * gb)
    return terms


def cpu_sync_seconds(load: Payload, *, transport: str, machine: Machine, buckets: int = 0) -> float:
    """Seconds of one verified sync of `load` on `machine` (`cpu_sync_terms`), in two spans:

    - the transfer: the sender's path (requests, assemble, stage, wire, then one engine rank's receive, read and
      load: on a node of a few cores the sender's and the engine ranks' copies compete for the same CPUs, so
      overlapping buckets saves little) with the sender's hashing thread (`HASH_TERMS`) beside it. Every runnable
      thread gets an equal share of the cores (Linux's fair scheduler): while the path keeps k threads busy on
      average (its CPU-seconds over its seconds: the sender's, the wire's `link_busy_cores`, the engine ranks'
      and the requests' `request_cpu_s`), the hashing thread gets cores / (k + 1) of a CPU (at most one) and the
      path slows by as much; the hashes left when the path ends run alone after it. The sync's `check_engines`
      waits for the last hash (`ExpectedChecksums.result`), so that tail is in the sync. The hashing thread is
      not held up by the GIL (SHA-256 and torch's copies release it; on `disk` safetensors' `save_file` left a
      hashing thread beside it 57-98% of its free rate, measured, where a torch copy beside it, competing for a
      CPU, left 25-47%): it waits on the run queue, as every thread does. Never shorter than all its CPU-seconds
      over `machine.cores`;
    - then the engines' checksums: one rank's `verify`, or all ranks' CPU-seconds over the cores.

    A thread runs no faster than the cores the sync gets when that is under one (`machine.cores`: what other jobs
    leave the sync)."""
    terms = cpu_sync_terms(load, transport=transport, machine=machine, buckets=buckets)
    cores = max(0.1, machine.cores)
    one = min(1.0, cores)  # the share of a CPU one thread can get
    path = sum(v for k, v in terms.items() if k not in HASH_TERMS + ("verify",))
    hashing = sum(terms[k] for k in HASH_TERMS)
    work, checks = cpu_sync_work(load, transport=transport, machine=machine, buckets=buckets)
    busy = (work - hashing) / path if path > 0 else 0.0  # threads the path keeps busy on average
    both = max(1 / one, (busy + 1) / cores)  # how much slower each thread runs while the hashes run beside the path
    alone = max(1 / one, busy / cores)  # the path's slowdown once they are done
    overlap = min(hashing, path)  # in one-thread seconds, of each: the hashing thread runs at the path's pace
    transfer = overlap * both + (path - overlap) * alone + (hashing - overlap) / one
    transfer = max(transfer, work / cores)
    return transfer + max(terms["verify"] / one, checks / cores)


def cpu_sync_work(load: Payload, *, transport: str, machine: Machine, buckets: int = 0) -> tuple[float, float]:
    """CPU-seconds of one sync of `load` on `machine`, of every thread and process (`cpu_sync_seconds`): (the
    transfer's, the engines' checksums')."""
    terms = cpu_sync_terms(load, transport=transport, machine=machine, buckets=buckets)
    stage_cpu = _stage_cpu(load, transport=transport, machine=machine, terms=terms)
    work = terms["assemble"] + stage_cpu + terms["hash"] + terms["contiguous"] \
        + terms.get("wire", 0.0) * machine.link_busy_cores
    work += (buckets + SYNC_REQUESTS) * machine.request_cpu_s
    work += load.engine_tp * sum(terms.get(k, 0.0) for k in ENGINE_TERMS if k != "verify")
    return work, load.engine_tp * terms["verify"]


def _stage_cpu(load: Payload, *, transport: str, machine: Machine, terms: dict[str, float]) -> float:
    """CPU-seconds of the sender's `stage` step: on `disk` the writes' at their CPU rate (their seconds wait on I/O
    as much), else the step's seconds."""
    if transport == "disk":
        return load.sender_bytes / ((machine.fs_write_cpu_gbyte_s or machine.copy_gbyte_s) * GB)
    return terms["stage"]
