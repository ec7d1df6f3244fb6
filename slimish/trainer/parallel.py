"""torch.distributed + Megatron-Core parallel state for one trainer process (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from slimish.collectives import resolve_backend

# How long a trainer collective may wait for its slowest rank before the job fails: torch's default, which a long
# step with uneven ranks (a pipeline's first stage waits a whole schedule for its first gradient) needs.
TRAINER_GROUP_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    rank: int
    world_size: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    virtual_pipeline: int = 1
    expert_tensor_parallel: int = 0  # 0: tensor_parallel (Megatron's default)

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel * self.context_parallel)

    @property
    def expert_tensor(self) -> int:
        """How many ranks split each expert's weights (parallel.expert_tensor_parallel, 0 resolved to TP)."""
        return self.expert_tensor_parallel or self.tensor_parallel

    @property
    def expert_data_parallel(self) -> int:
        """The experts' data-parallel size: Megatron's world / (ETP x EP x PP)."""
        return self.world_size // (self.expert_tensor * self.expert_parallel * self.pipeline_parallel)


def init_parallel(layout: ParallelLayout, *, master_addr: str, master_port: int, backend: str, seed: int) -> None:
    """Join the trainer process group and set up Megatron's TP/PP/CP/DP groups and the experts' ETP/EP/EDP groups;
    seeds Megatron's RNG tracker."""
    from slimish.compat import megatron_cpu

    megatron_cpu.apply()  # no-op with CUDA
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    backend = resolve_backend(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(layout.rank % torch.cuda.device_count())
    if not dist.is_initialized():
        timeout = TRAINER_GROUP_TIMEOUT
        dist.init_process_group(backend=backend, store=_rendezvous_store(layout, master_addr, master_port, timeout),
                                rank=layout.rank, world_size=layout.world_size, timeout=timeout)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tensor_parallel,
                                                 pipeline_model_parallel_size=layout.pipeline_parallel,
                                                 context_parallel_size=layout.context_parallel,
                                                 virtual_pipeline_model_parallel_size=layout.virtual_pipeline
                                                 if layout.virtual_pipeline > 1 else None,
                                                 expert_model_parallel_size=layout.expert_parallel,
                                                 expert_tensor_parallel_size=layout.expert_tensor)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _rendezvous_store(layout: ParallelLayout, master_addr: str, master_port: int, timeout: timedelta):
    """Rank 0 hosts the store on `master_addr` only (see slimish/network.py); the other ranks connect to it."""
    import torch.distributed as dist

    from slimish.network import hosted_store

    if layout.rank == 0:
        return hosted_store(master_addr, master_port, world_size=layout.world_size, timeout=timeout)[0]
    return dist.TCPStore(master_addr, master_port, layout.world_size, False, timeout)


def shutdown_parallel() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
