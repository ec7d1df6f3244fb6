"""The one way slimish all-reduces a tensor: on the device its process group works on.

An NCCL group takes GPU tensors only and a gloo group CPU tensors only, and the statistics the trainer reduces
(token counts, parity sums, whitening moments) are made wherever their inputs live: in host memory for the step's
host-side data, on the GPU for what a forward pass returns. `all_reduce` moves the tensor to its group's device and
the result back, so callers never choose. (The model's own tensors - gradients, weight-sync buckets, export
gathers - already live on the device their groups use.)
"""

from __future__ import annotations

import torch


def resolve_backend(backend: str) -> str:
    """`parallel.backend` made concrete: auto is nccl with CUDA, else gloo; nccl without usable CUDA is a UserError
    saying why (it would otherwise fail deep in the first collective)."""
    if backend == "nccl" and not torch.cuda.is_available():
        from slimish import cuda_facts
        from slimish.errors import UserError

        facts = cuda_facts.collect()
        raise UserError(f"parallel.backend is nccl, but on {facts.node} {cuda_facts.cause(facts)}; or set "
                        "parallel.backend=gloo")
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def group_device(group=None) -> torch.device:
    """The device `group`'s collectives take tensors on: the current CUDA device for NCCL, the emulated GPU for a
    group that stands for NCCL in the emulated-GPU tier, else the CPU."""
    import torch.distributed as dist

    from slimish.compat import emulated_gpu

    if emulated_gpu.enabled():
        return emulated_gpu.DEVICE if emulated_gpu.group_is_gpu(group) else torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, *, group=None, op: str = "sum") -> torch.Tensor:
    """A new tensor: `tensor` reduced over `group` (op "sum" or "max"), on `tensor`'s device. Without an initialised
    process group (one process, no torch.distributed) `tensor` itself, copied."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor.clone()
    reduced = tensor.detach().to(group_device(group), copy=True)
    dist.all_reduce(reduced, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return reduced.to(tensor.device)


def _check_on_group_device(op: str, tensor: torch.Tensor, group) -> None:
    # Bulk tensors (buckets, exported weights) are made on the device their group uses; copying them here would hide
    # the mistake and, for a receive, lose the result.
    expected = group_device(group)
    if tensor.device.type != expected.type:
        raise ValueError(f"{op}: a tensor of shape {tuple(tensor.shape)} on {tensor.device}, but its process group "
                         f"works on {expected}: make it there")


def broadcast(tensor: torch.Tensor, *, src: int, group, async_op: bool = False):
    """torch.distributed.broadcast of `tensor` (in place), which must be on its group's device; with `async_op`, the
    collective's Work (wait on it), else None."""
    import torch.distributed as dist

    _check_on_group_device("broadcast", tensor, group)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, *, dst: int, group) -> None:
    import torch.distributed as dist

    _check_on_group_device("send", tensor, group)
    dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, *, src: int, group) -> None:
    """Receive into `tensor`, which must be on its group's device."""
    import torch.distributed as dist

    _check_on_group_device("recv", tensor, group)
    dist.recv(tensor, src=src, group=group)


def all_gather(tensor: torch.Tensor, *, group, world_size: int) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on every rank), in rank order; `tensor` must be on its group's device."""
    import torch.distributed as dist

    _check_on_group_device("all_gather", tensor, group)
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts
