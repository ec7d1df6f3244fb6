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
             replicates, norms and routers, is under 0.1% of a large model: not counted).
  broadcast is not sharded (`engine_shards` is ignored): every engine rank still receives every byte over the one
             group. `tensor` (one node, memory handles) has no wire.
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
                 stage_senders: bool = True, engine_shards: int = 1) -> float:
    """Seconds on the wire to move `model_bytes` to every engine with `transport` (see the module docstring);
    `engine_shards` > 1: the sharded sync to engines of that many tensor-parallel ranks."""
    if transport == "broadcast":
        link = cluster.nic_gbit_s / 8 * GB
        funnel = 0.0 if stage_senders else model_bytes * (pipeline_parallel - 1) / pipeline_parallel / link
        return model_bytes / link + funnel
    if transport == "disk":
        return (model_bytes / (cluster.fs_write_gbyte_s * GB)
                + model_bytes / engine_shards / (cluster.fs_read_gbyte_s * GB))
    raise ValueError(f"no estimate for transport {transport!r}; known: 'broadcast', 'disk'")
