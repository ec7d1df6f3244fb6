"""An emulated GPU for the CPU test tier: a device that is not the CPU, with real CPU arithmetic behind it.

On a CPU machine `megatron_cpu.apply()` sends every `.cuda()` and `device="cuda"` to the CPU, which is exactly what
hides a tensor the trainer forgot to move: on a GPU that tensor meets a CUDA weight and the step crashes. With
`SLIMISH_EMULATED_GPU=1` those calls go to this module's device instead (`DEVICE`, "emulated_gpu:0"), a PyTorch
PrivateUse1 backend registered from Python: its tensors (`EmulatedGpuTensor`) hold a CPU tensor and run every op on
it, but report the emulated device, so that

- an op mixing an emulated-GPU tensor with a CPU tensor raises as CUDA does ("Expected all tensors to be on the same
  device..."), except where CUDA allows it (0-dim CPU scalars, CPU indices, copies between devices);
- a collective on a group that would be NCCL on a GPU (every group but those created with backend="gloo", as
  Megatron's *_gloo groups are) refuses a CPU tensor as NCCL does, and runs over gloo on the CPU data otherwise
  (the stand-in at the NCCL boundary: `_patch_collectives`);
- autograd, optimizers, `.item()` and `.tolist()` work, so whole training steps run with their real numbers;
- Megatron's CPU-offloading optimizer sees its tensors as CUDA ones where it sorts what to offload
  (`patch_hybrid_optimizer`), and nowhere else; a tensor's `untyped_storage()` is its CPU data's, which Megatron's
  selective recompute frees and refills;
- `F.scaled_dot_product_attention` runs the kernel the CPU picks (its fused flash kernel), not the S x S math
  kernel torch falls back to for a Python backend (its kernel choice for PrivateUse1 is a C++ dispatch stub):
  `_sdpa_on_cpu_kernels`.

Enabled once per process by `megatron_cpu.apply()` when `SLIMISH_EMULATED_GPU=1`, before any model is built.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref

import torch
from torch.utils._pytree import tree_map

ENV = "SLIMISH_EMULATED_GPU"
BACKEND_NAME = "emulated_gpu"
DEVICE: torch.device | None = None  # torch.device("emulated_gpu", 0) once `enable()` has registered the name
_CPU = torch.device("cpu")
_ENABLED = False
_AS_CUDA = False  # what an emulated-GPU tensor's `is_cuda` answers: True only inside `_as_cuda` (see there)
_aten = torch.ops.aten
# Ops that move data between devices, and the indexing ops, which CUDA lets take CPU index tensors.
_CROSS_DEVICE = {_aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default,
                 _aten._copy_from_and_resize.default}
_CPU_INDICES_ALLOWED = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
                        _aten._index_put_impl_.default}


def requested() -> bool:
    """True when this process is to run with the emulated GPU (SLIMISH_EMULATED_GPU=1)."""
    return os.environ.get(ENV, "") == "1"


def enabled() -> bool:
    return _ENABLED


class _Memory:
    """The bytes the emulated device holds, as CUDA's caching allocator counts allocated bytes: each storage once,
    from its first emulated tensor until its last is gone; and the peak since `reset_peak`. Off unless `track()`ed
    (SLIMISH_EMULATED_GPU_MEMORY=1 in a process): a finalizer per tensor costs every op a little."""

    def __init__(self):
        self.on = False
        self.held = self.peak = 0
        self._wrappers: dict[int, list[int]] = {}  # storage pointer -> [wrappers alive, its bytes]

    def take(self, wrapper, data: torch.Tensor) -> None:
        if not self.on or data.device.type != "cpu":
            return
        storage = data.untyped_storage()
        key = storage.data_ptr()
        if not key:  # an empty storage
            return
        entry = self._wrappers.get(key)
        if entry is None:
            entry = self._wrappers[key] = [0, storage.nbytes()]
            self.held += entry[1]
            self.peak = max(self.peak, self.held)
        entry[0] += 1
        wrapper._memory_release = weakref.finalize(wrapper, self._drop, key)

    def release(self, wrapper) -> None:
        """`wrapper` no longer views the storage it was counted for (its `.data` was re-pointed): that storage's
        bytes go when its last wrapper does, as CUDA frees a parameter's old storage once nothing else views it."""
        release = getattr(wrapper, "_memory_release", None)
        if release is not None and release.alive:
            release()  # runs `_drop` now, once: the finalizer is then dead

    def _drop(self, key: int) -> None:
        entry = self._wrappers.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.held -= entry[1]
            del self._wrappers[key]


MEMORY = _Memory()
MEMORY_ENV = "SLIMISH_EMULATED_GPU_MEMORY"


def track_memory() -> None:
    """Count the bytes the emulated device holds from now on (`memory_allocated`, `max_memory_allocated`)."""
    MEMORY.on = True


def memory_allocated() -> int:
    return MEMORY.held


def max_memory_allocated() -> int:
    return MEMORY.peak


def reset_peak_memory_stats() -> None:
    MEMORY.peak = MEMORY.held


class DeviceMismatch(RuntimeError):
    """An op or collective got a tensor on the wrong device: what would crash on a GPU."""


class EmulatedGpuTensor(torch.Tensor):
    """A tensor on the emulated GPU: CPU data (`cpu_data`), the emulated device on the outside."""

    cpu_data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=DEVICE, layout=data.layout, requires_grad=requires_grad)
        tensor.cpu_data = data
        MEMORY.take(tensor, data)
        return tensor

    def __repr__(self, *, tensor_contents=None):
        return f"EmulatedGpuTensor({self.cpu_data!r})"

    def tolist(self):
        return self.cpu_data.tolist()

    @property
    def is_cuda(self):
        return _AS_CUDA

    def untyped_storage(self):
        # The storage its data is in, as a CUDA tensor's is: Megatron frees a recomputed output's memory by resizing
        # its storage to 0 bytes and puts the recomputed bytes back into it (selective recompute's
        # CheckpointWithoutOutput), as slimish's offload does.
        return self.cpu_data.untyped_storage()

    @property
    def data(self):
        return super().data

    @data.setter
    def data(self, value):
        # `param.data = buffer_view` (Megatron's DDP and distributed optimizer point parameters into their
        # buffers): the wrapper must then read and write the buffer's CPU data.
        torch.Tensor.data.__set__(self, value)
        self.cpu_data = value.cpu_data if isinstance(value, EmulatedGpuTensor) else value
        MEMORY.release(self)  # the old storage: counted until its other views go (it was counted forever)
        MEMORY.take(self, self.cpu_data)  # the buffer it now views

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _wrap(out):
    return tree_map(lambda x: EmulatedGpuTensor(x) if type(x) is torch.Tensor else x, out)


def _run(func, args, kwargs):
    """Run `func` on the CPU data of its emulated-GPU arguments; results come back on the emulated GPU (or on the
    CPU when `func` copies to it)."""
    on_cpu = []

    def unwrap(x):
        if isinstance(x, EmulatedGpuTensor):
            return x.cpu_data
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
            on_cpu.append(x)
        return x

    cpu_args, cpu_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if on_cpu and func not in _CROSS_DEVICE:
        indices_only = func in _CPU_INDICES_ALLOWED and all(x is not args[0] for x in on_cpu)
        if not indices_only:
            raise DeviceMismatch(f"Expected all tensors to be on the same device, but found at least two devices, "
                                 f"{DEVICE} and cpu! ({func}, emulated GPU)")
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        return func(*cpu_args, **cpu_kwargs)  # a copy to the CPU: a plain CPU tensor
    if device is not None:
        cpu_kwargs["device"] = _CPU
    out = func(*cpu_args, **cpu_kwargs)
    if func is _aten.copy_.default:
        return args[0]
    return _wrap(out)


def _backend_fallback(op, *args, **kwargs):
    # Factory calls naming the emulated device (torch.empty(..., device=DEVICE)) and copies of CPU tensors to it
    # arrive at the backend itself: no argument is an EmulatedGpuTensor yet.
    return _run(op, args, kwargs)


def _tensor_factory(original):
    # torch.tensor / as_tensor with device=DEVICE, or of (lists of) emulated-GPU tensors, take paths the Python
    # backend cannot serve: built from the CPU data, then copied to the device CUDA would give them.
    @functools.wraps(original)
    def factory(data, *args, device=None, **kwargs):
        if isinstance(data, EmulatedGpuTensor):
            target = DEVICE if device is None else device
            return original(data.cpu_data, *args, **kwargs).to(target)
        data = tree_map(lambda x: x.cpu_data if isinstance(x, EmulatedGpuTensor) else x, data)
        if device is not None and torch.device(device).type == BACKEND_NAME:
            return original(data, *args, **kwargs).to(DEVICE)
        return original(data, *args, device=device, **kwargs)

    return factory


class _CpuSdpa(torch.autograd.Function):
    """SDPA of emulated-GPU tensors by the CPU's own call on their CPU data, forward and backward (so the kernel, and
    the numbers, are those of the same step on the CPU)."""

    @staticmethod
    def forward(ctx, query, key, value, kwargs):
        inputs = [x.cpu_data.detach().requires_grad_(x.requires_grad) for x in (query, key, value)]
        with torch.enable_grad():
            out = _CPU_SDPA(*inputs, **kwargs)
        ctx.graph = (inputs, out)
        return EmulatedGpuTensor(out.detach())

    @staticmethod
    def backward(ctx, grad):
        inputs, out = ctx.graph
        wanted = [x for x in inputs if x.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad.cpu_data))
        return (*(EmulatedGpuTensor(next(grads)) if x.requires_grad else None for x in inputs), None)


_CPU_SDPA = torch.nn.functional.scaled_dot_product_attention


@functools.wraps(_CPU_SDPA)
def _sdpa_on_cpu_kernels(query, key, value, attn_mask=None, **kwargs):
    if attn_mask is None and all(isinstance(x, EmulatedGpuTensor) for x in (query, key, value)):
        return _CpuSdpa.apply(query, key, value, kwargs)
    # Mixed devices raise through the op's own path as on CUDA (`_run`); a mask (never the trainer's) runs there too.
    return _CPU_SDPA(query, key, value, attn_mask, **kwargs)


# ----------------------------------------------------------------------------------- the NCCL boundary
_CPU_GROUPS: set = set()  # groups created with backend="gloo": CPU tensors there, as on a GPU cluster
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "reduce_scatter", "reduce", "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv",
                "gather", "scatter")


def group_is_gpu(group) -> bool:
    """Whether `group` stands for an NCCL group (tensors on the GPU) rather than a gloo one (tensors on the CPU)."""
    return group not in _CPU_GROUPS


def _group_of(name: str, args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]
    position = {"all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2,
                "reduce_scatter_tensor": 3, "reduce_scatter": 3, "reduce": 3, "all_to_all_single": 4,
                "all_to_all": 2, "send": 2, "recv": 2, "isend": 2, "irecv": 2, "gather": 3, "scatter": 3}[name]
    return args[position] if len(args) > position else None


def _unwrap_for_collective(name: str, group, value):
    gpu = group_is_gpu(group)

    def unwrap(x):
        if not isinstance(x, torch.Tensor):
            return x
        if isinstance(x, EmulatedGpuTensor):
            if not gpu:
                raise DeviceMismatch(f"{name} on a gloo group got a tensor on {DEVICE}: gloo takes CPU tensors")
            return x.cpu_data
        if gpu:
            raise DeviceMismatch(f"{name} on an NCCL group got a CPU tensor {tuple(x.shape)}: NCCL takes GPU tensors "
                                 "(emulated GPU)")
        return x

    return tree_map(unwrap, value)


def _collective(name: str, original):
    @functools.wraps(original)
    def call(*args, **kwargs):
        group = _group_of(name, args, kwargs)
        return original(*_unwrap_for_collective(name, group, args),
                        **{k: _unwrap_for_collective(name, group, v) for k, v in kwargs.items()})

    return call


def _patch_collectives() -> None:
    """Replace the collectives in the `torch.distributed` namespace (what Megatron and slimish call; torch's own
    object collectives keep the originals) with ones that check devices as NCCL would and run on CPU data."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in _COLLECTIVES:
        setattr(dist, name, _collective(name, getattr(c10d, name)))

    original_new_group = c10d.new_group

    @functools.wraps(original_new_group)
    def new_group(*args, **kwargs):
        group = original_new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and str(backend).lower() == "gloo":
            _CPU_GROUPS.add(group)
        return group

    dist.new_group = new_group

    original_p2p = c10d.P2POp

    def p2p_op(op, tensor, peer=None, group=None, tag=0, group_peer=None):
        op = c10d.isend if op in (dist.isend, c10d.isend) else c10d.irecv
        return original_p2p(op, _unwrap_for_collective("P2POp", group, tensor), peer, group, tag, group_peer)

    dist.P2POp = p2p_op


class _BackendModule:
    """`torch.emulated_gpu`: what torch asks of a device's module (activation checkpointing's autocast context)."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass

    @staticmethod
    def memory_allocated(*_args) -> int:
        return memory_allocated()

    @staticmethod
    def max_memory_allocated(*_args) -> int:
        return max_memory_allocated()

    @staticmethod
    def reset_peak_memory_stats(*_args) -> None:
        reset_peak_memory_stats()

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]


@contextlib.contextmanager
def _as_cuda():
    global _AS_CUDA
    _AS_CUDA = True
    try:
        yield
    finally:
        _AS_CUDA = False


def patch_hybrid_optimizer() -> None:
    """Megatron's CPU-offloading optimizer (`HybridDeviceOptimizer`, trainer.optimizer.cpu_offload) picks the
    parameters it offloads by `param.is_cuda`. An emulated-GPU tensor answers False (its device is not CUDA, and
    code that asks, such as SGLang's Triton hash in the weight-sync checksums, would launch a GPU kernel), except
    while that optimizer sorts its parameters: there it answers as a CUDA tensor would. Idempotent."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    original = HybridDeviceOptimizer._get_sub_optimizer_param_groups
    if getattr(original, "_emulated_gpu", False):
        return

    @functools.wraps(original)
    def sort_params(self, offload_fraction):
        with _as_cuda():
            return original(self, offload_fraction)

    sort_params._emulated_gpu = True
    HybridDeviceOptimizer._get_sub_optimizer_param_groups = sort_params


def enable() -> None:
    """Register the emulated device and its boundaries in this process. Idempotent."""
    global _ENABLED, DEVICE
    if _ENABLED:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=BACKEND_NAME, backend_module=_BackendModule())
    DEVICE = torch.device(BACKEND_NAME, 0)
    library = torch.library.Library("_", "IMPL")
    library.fallback(_backend_fallback, "PrivateUse1")
    enable.library = library  # registrations last as long as their Library object
    torch.tensor = _tensor_factory(torch.tensor)
    torch.as_tensor = _tensor_factory(torch.as_tensor)
    torch.nn.functional.scaled_dot_product_attention = _sdpa_on_cpu_kernels
    _patch_collectives()
    if os.environ.get(MEMORY_ENV, "") == "1":
        track_memory()
    _ENABLED = True
