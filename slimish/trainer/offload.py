"""A trainer role's device memory moved to host memory and back: what a colocated trainer does while the engines
generate on its GPUs, so that between its steps it holds nothing there.

What moves: every device storage a role keeps between steps, in two parts that may move at different times:
"params", its parameters (or the DDP buffer they view) and module buffers; "state", its optimizer's main parameters
and state (Adam's moments, the fp32 copies of a bf16 model) and its gradients. Kept bytes go to host memory (pinned
on a GPU). Gradients (DDP's grad buffer, `.grad`) are freed without a copy: every step zeroes them first
(`schedule.optimizer_step`), and onload gives them back zeroed. A colocated trainer offloads "state" after training
and "params" after the weight sync that reads them.

How: each storage is resized to zero bytes once its bytes are safe, which frees its device memory but keeps every
tensor viewing it (a parameter in DDP's buffer, the optimizer's references, Megatron's bucket views) the same Python
object; onload resizes it back and copies the bytes in. Nothing is rebuilt, no reference held elsewhere goes stale,
and the round trip is bit-exact. Megatron-Core resizes its DDP buffers the same way
(`_ParamAndGradBuffer.offload_to_cpu`), but moves optimizer state by replacing tensors and has no pass over a whole
role; this one covers every storage of the role at once.

On the CPU the trainer's memory is host memory already: there is nothing to move, and both calls report 0 bytes. On
the emulated GPU (`slimish.compat.emulated_gpu`), whose tensors hold their data in CPU tensors, the storages resized
are those CPU tensors': the same moves, on that data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Stored:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # the bytes while offloaded; None for a gradient (zeroed on onload)


@dataclass
class OffloadedRole:
    """What `offload` took from one role, for `onload` to give back."""
    stored: list[_Stored] = field(default_factory=list)

    @property
    def bytes_copied(self) -> int:
        return sum(s.nbytes for s in self.stored if s.host is not None)

    @property
    def bytes_freed(self) -> int:
        return sum(s.nbytes for s in self.stored)


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding `tensor`'s data (on the emulated GPU, its CPU tensor's)."""
    return getattr(tensor, "cpu_data", tensor).untyped_storage()


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole of `storage` as a uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (a chained one holds one per parameter group kind)."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in _torch_optimizers(opt)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


PARTS = ("params", "state")


def role_tensors(modules: list[torch.nn.Module], optimizer=None) -> dict[str, list[torch.Tensor]]:
    """{"params": the model's kept tensors, "state": the optimizer's kept tensors, "grads": the gradients}: one
    tensor per storage that is on the trainer's device and not offloaded, each storage in one list only (the first
    of those that holds it: an fp32 optimizer's parameters are the model's)."""
    found: dict[str, list[torch.Tensor]] = {"params": [], "state": [], "grads": []}
    seen: set[int] = set()  # storages found already

    def add(part: str, tensor) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
            storage = _storage(tensor)
            if storage.nbytes() > 0 and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                found[part].append(tensor)

    for module in modules:
        for param in module.parameters():
            add("params", param)
        for buffer in module.buffers():
            add("params", buffer)
    inners = _torch_optimizers(optimizer)
    for inner in inners:
        for group in inner.param_groups:
            for param in group["params"]:
                add("state", param)
        for state in inner.state.values():
            for value in state.values():
                add("state", value)
    for module in modules:
        for param in module.parameters():
            add("grads", getattr(param, "main_grad", None))
            add("grads", param.grad)
    for inner in inners:
        for group in inner.param_groups:
            for param in group["params"]:
                add("grads", param.grad)
    return found


def device_bytes(modules: list[torch.nn.Module], optimizer=None) -> int:
    """What a role holds on the trainer's device now (0 once offloaded)."""
    return sum(_storage(t).nbytes() for tensors in role_tensors(modules, optimizer).values() for t in tensors)


def offload(modules: list[torch.nn.Module], optimizer=None, parts: tuple[str, ...] = PARTS) -> OffloadedRole:
    """Move `parts` of a role's device storages to host memory (see the module docstring); nothing on the CPU."""
    tensors = role_tensors(modules, optimizer)
    moved = [(t, True) for part in PARTS if part in parts for t in tensors[part]]
    if "state" in parts:
        moved += [(t, False) for t in tensors["grads"]]
    pin = torch.cuda.is_available()
    out = OffloadedRole()
    for tensor, keep in moved:
        storage = _storage(tensor)
        host = None
        if keep:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_bytes_view(storage))  # blocking: the bytes are in host memory before the storage goes
        out.stored.append(_Stored(storage, storage.nbytes(), host))
        storage.resize_(0)
    if pin:
        # cuBLAS keeps its workspaces in torch's caching allocator, per handle and stream, for as long as the process
        # lives (tens of MiB per GPU); they are made again at the next matmul. Then all of it goes back to the
        # driver, for the engines on this GPU.
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    return out


def onload(offloaded: OffloadedRole) -> None:
    """Give back what `offload` took: every storage at its size, kept bytes copied in, gradients zeroed."""
    for stored in offloaded.stored:
        stored.storage.resize_(stored.nbytes)
        view = _bytes_view(stored.storage)
        if stored.host is None:
            view.zero_()
        else:
            view.copy_(stored.host)
    offloaded.stored.clear()
