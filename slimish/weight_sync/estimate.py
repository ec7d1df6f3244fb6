"""Sync time on paper: what each transport would take for a model on a stated cluster, from the bytes each link
carries and its bandwidth (for the planning tools and the README's scale table; nothing here has run on a GPU).

The model is the wire only: control calls, export gathers and the engines' copy into their parameters come on top
(measured on CPU in bench/weight_sync.py, where they dominate; on GPU they overlap with the wire, see broadcast.py).

  broadcast  every engine rank receives every byte (SGLang's /update_weights_from_distributed hands full tensors to
             each tensor-parallel rank), one bucket at a time (an engine serves one update request at a time): an
             NCCL broadcast pipelines a bucket to all receivers, so a sync takes model bytes / NIC bandwidth,
             whatever the number of engines, and whatever the number of senders: stage senders
             (slimish.weight_sync.stages) take turns on the wire. Without them (`stage_senders=False`) trainer rank 0
             first takes in the later pipeline stages' share of the model, on the thread that sends (counted here as
             not overlapped).
  disk       the sender writes every byte to a shared filesystem, then every engine reads it all: bytes / write
             bandwidth + bytes / (read bandwidth per engine), engines reading in parallel. Sharded
             (`engine_shards` = the engines' tensor-parallel size, weight_sync.sharded): each engine rank reads only
             its own files, 1 / t of the bytes, the ranks in parallel at the read bandwidth each (what SGLang
             replicates, norms and routers, is counted when given as `replicated_bytes`; `plan` gives 0: under
             0.1% of a large model).
  broadcast is not sharded (`engine_shards` is ignored): every engine rank still receives every byte over the one
             group. `tensor` (one node, memory handles) has no wire.

`cpu_sync_seconds` models the other end: one CPU node, where a sync is copies, checksums, a loopback broadcast,
page-cache files and engine requests (`Machine`, rates the bench measures in the same run), for the bytes a sync
really moves (`payload`: per engine rank its shard plus what SGLang replicates when sharded, the whole model when
not; the sender's total). bench/weight_sync.py --engine-tp 2 checks it against measured syncs (docs/weight-sync.md,
"Calibration on the CPU").
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Cluster:
    nic_gbit_s: float = 400.0        # per GPU (H100/H200 nodes: one 400 Gb/s NIC per GPU)
    fs_write_gbyte_s: float = 10.0   # one writer to a parallel filesystem
    fs_read_gbyte_s: float = 10.0    # one engine reading from it


def sync_seconds(model_bytes: float, *, transport: str, cluster: Cluster = Cluster(), pipeline_parallel: int = 1,
                 stage_senders: bool = True, engine_shards: int = 1, replicated_bytes: float = 0.0) -> float:
    """Seconds on the wire to move `model_bytes` to every engine with `transport` (see the module docstring);
    `engine_shards` > 1: the sharded sync to engines of that many tensor-parallel ranks, of which every rank holds
    `replicated_bytes` whole (`payload`: the writer writes them once per rank, each rank reads its shard and them;
    0, as `slimish plan` passes it, is the 1/t split)."""
    if transport == "broadcast":
        link = cluster.nic_gbit_s / 8 * GB
        funnel = 0.0 if stage_senders else model_bytes * (pipeline_parallel - 1) / pipeline_parallel / link
        return model_bytes / link + funnel
    if transport == "disk":
        if engine_shards == 1:
            return model_bytes / (cluster.fs_write_gbyte_s * GB) + model_bytes / (cluster.fs_read_gbyte_s * GB)
        load = payload(model_bytes, engine_tp=engine_shards, sharded=True, replicated_bytes=replicated_bytes)
        return load.sender_bytes / (cluster.fs_write_gbyte_s * GB) + load.rank_bytes / (cluster.fs_read_gbyte_s * GB)
    raise ValueError(f"no estimate for transport {transport!r}; known: 'broadcast', 'disk'")


# ---------------------------------------------------------------------------------------------- the CPU, calibrated
# On one CPU node (bench/weight_sync.py --engine-tp 2) there is no wire worth the name: a sync is memory copies,
# SHA-256 checksums, a gloo broadcast over loopback and page-cache file I/O, all on the same few cores. The terms
# below are measured by the bench in the same run, never fitted per case.


@dataclass(frozen=True, kw_only=True)
class Machine:
    """One node's measured rates, GB/s (1e9 bytes): `copy_gbyte_s` a tensor copy into a reused buffer (the sender's
    flatten, an engine's copy into its parameters), `hash_gbyte_s` SGLang's CPU checksum (SHA-256), `link_gbyte_s`
    bytes leaving a gloo broadcast's sender per second (a broadcast of n bytes to k receivers puts out k x n),
    `fs_write_gbyte_s` / `fs_read_gbyte_s` writing and reading a file in the disk transport's directory;
    `request_s` one engine request's round trip through its scheduler and tensor-parallel workers."""
    copy_gbyte_s: float
    hash_gbyte_s: float
    link_gbyte_s: float
    fs_write_gbyte_s: float
    fs_read_gbyte_s: float
    request_s: float = 0.0


# Engine requests per sync besides one per bucket: /begin_weight_update, /end_weight_update, /weights_checker and
# /model_info (the version).
SYNC_REQUESTS = 4


@dataclass(frozen=True, kw_only=True)
class Payload:
    """The bytes of one sync to one engine of `engine_tp` ranks. `rank_bytes`: what each engine rank receives;
    `sender_bytes`: what the sender stages (written, flattened) in all; `held_bytes`: what each rank holds (copied
    into its parameters, then checksummed); `link_bytes`: what leaves the sender on a broadcast; `assembled_bytes`:
    the fused parameters the sharded sender builds whole before cutting them (a second copy)."""
    engine_tp: int
    rank_bytes: float
    sender_bytes: float
    held_bytes: float
    link_bytes: float
    assembled_bytes: float


def payload(model_bytes: float, *, engine_tp: int, sharded: bool, replicated_bytes: float = 0.0,
            fused_bytes: float = 0.0) -> Payload:
    """What a sync moves: full, every rank receives `model_bytes` and keeps its shard plus what SGLang replicates
    (`replicated_bytes`, norms: every rank holds them whole), the sender stages the model once and a broadcast puts
    it out once per rank; sharded, each rank receives exactly what it holds and the sender stages every rank's
    payload (the model plus t - 1 more copies of the replicated tensors), assembling each fused parameter
    (`fused_bytes`: q/k/v, gate/up) whole first."""
    held = (model_bytes - replicated_bytes) / engine_tp + replicated_bytes
    if sharded:
        return Payload(engine_tp=engine_tp, rank_bytes=held, sender_bytes=held * engine_tp, held_bytes=held,
                       link_bytes=held * engine_tp, assembled_bytes=fused_bytes)
    return Payload(engine_tp=engine_tp, rank_bytes=model_bytes, sender_bytes=model_bytes, held_bytes=held,
                   link_bytes=model_bytes * engine_tp, assembled_bytes=0.0)


def cpu_sync_terms(load: Payload, *, transport: str, machine: Machine, buckets: int = 0) -> dict[str, float]:
    """Seconds per step of one sync on `machine`; `cpu_sync_seconds` says how they add up. `assemble`, `stage`
    (flatten, or write the files), `wire` / `read` and `load` (each engine rank's copy into its parameters, the
    ranks in parallel) are the sender's path, counted one after another: on a node of a few cores the sender's
    copies and the engine ranks' copies compete for the same CPUs, so overlapping buckets saves little (the bench's
    phases show it). `hash`: the sender's checksums, on a thread of their own beside that path. `verify`: the engine
    ranks' checksums of what they hold, after the last bucket. `requests`: one engine request per bucket
    (`buckets`) and `SYNC_REQUESTS` more, one after another, in the sender's path."""
    copy, gb = machine.copy_gbyte_s * GB, GB
    terms = {"requests": (buckets + SYNC_REQUESTS) * machine.request_s, "assemble": load.assembled_bytes / copy}
    if transport == "tensor":
        terms["stage"] = load.sender_bytes / copy
    elif transport == "broadcast":
        terms["stage"] = load.sender_bytes / copy
        terms["wire"] = load.link_bytes / (machine.link_gbyte_s * gb)
    elif transport == "disk":
        terms["stage"] = load.sender_bytes / (machine.fs_write_gbyte_s * gb)
        terms["read"] = load.rank_bytes / (machine.fs_read_gbyte_s * gb)
    else:
        raise ValueError(f"no estimate for transport {transport!r}; known: 'broadcast', 'disk', 'tensor'")
    terms["load"] = load.held_bytes / copy
    terms["hash"] = load.sender_bytes / (machine.hash_gbyte_s * gb)
    terms["verify"] = load.held_bytes / (machine.hash_gbyte_s * gb)
    return terms


def cpu_sync_seconds(load: Payload, *, transport: str, machine: Machine, buckets: int = 0) -> float:
    """Seconds of one verified sync of `load` on `machine`: the sender's path or its hashing thread, whichever ends
    last, then the engines' checksums (`cpu_sync_terms`)."""
    terms = cpu_sync_terms(load, transport=transport, machine=machine, buckets=buckets)
    path = sum(v for k, v in terms.items() if k not in ("hash", "verify"))
    return max(path, terms["hash"]) + terms["verify"]
