"""The trainer's device, and moving host data to it.

One place decides where a trainer process computes: its CUDA device on a GPU, the emulated GPU in the test tier that
checks device discipline (`slimish.compat.emulated_gpu`), else the CPU. Everything else in `trainer/` takes its
device from its inputs (a micro-batch from the model's parameters, a new tensor from the tensor it goes with).
"""

from __future__ import annotations

import torch


def trainer_device() -> torch.device:
    """This process's compute device (after `init_parallel`, which picks the CUDA device of a GPU rank)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    from slimish.compat import emulated_gpu

    return emulated_gpu.DEVICE if emulated_gpu.enabled() else torch.device("cpu")


def module_device(module: torch.nn.Module) -> torch.device:
    """Where `module`'s parameters live (a pipeline stage always holds some)."""
    return next(module.parameters()).device


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in host memory (pinned when a GPU will read it back, so the copy there can be asynchronous): one
    copy, straight into the pinned buffer."""
    tensor = tensor.detach()
    if not torch.cuda.is_available():
        return tensor.to("cpu")
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True).copy_(tensor)
