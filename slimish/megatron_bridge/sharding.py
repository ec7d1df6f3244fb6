"""Tensor-parallel slicing and gathering of full Megatron tensors, driven by Megatron's own parameter attributes.

Megatron marks each tensor-parallel parameter with `tensor_model_parallel=True` and `partition_dim`. The only
layout that is not a plain contiguous chunk is the gated MLP's `linear_fc1`, whose shard on each rank is
[gate_shard; up_shard]: it is sliced (and gathered) per half. MLA's down projections are column-parallel in the
local spec (sharded rows, output gathered) and duplicated in the TE spec (no attribute): both follow the attributes.
"""

from __future__ import annotations

import torch

from slimish import collectives


def is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def shard(full: torch.Tensor, param: torch.Tensor, kind: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of `full` for `param`."""
    if tp_size == 1 or not is_tp_sharded(param):
        return full
    dim = param.partition_dim
    if kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def gather(local: torch.Tensor, param: torch.Tensor, kind: str, tp_group, tp_size: int) -> torch.Tensor:
    """The full tensor from every rank's `local` slice (a collective over `tp_group` when sharded)."""
    if tp_size == 1 or not is_tp_sharded(param):
        return local
    parts = collectives.all_gather(local, group=tp_group, world_size=tp_size)
    if kind == "gate_up":
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=param.partition_dim)
