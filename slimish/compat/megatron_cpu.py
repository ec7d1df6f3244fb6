"""What makes stock Megatron-Core (0.16-0.19) train on a CPU-only torch over gloo. Applied only when CUDA is absent.

Megatron-Core assumes a GPU in a few places that are not about the maths: it asks for the current CUDA device to
place tensors, allocates some buffers with device="cuda", keeps its dropout RNG states as CUDA generator states,
synchronises streams, and checks tensor types by name (`t.type() == 'torch.cuda.BFloat16Tensor'`) in its
optimizers and grad clipping. `apply()` redirects exactly those to the CPU so the same model, schedules, optimizers
(fp32 and bf16 mixed precision) and checkpointing code runs; the maths is untouched. On a GPU machine
`apply()` does nothing and nothing here is imported by the trainer's logic.

Call `apply()` before the first `import megatron.core` in a process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import types

import torch

_APPLIED = False
# Where Megatron's "cuda" goes: the CPU, or the emulated GPU (`slimish.compat.emulated_gpu`) in the test tier that
# checks device discipline.
_TARGET = torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _redirect_device_kwarg(owner, name: str, source=None) -> None:
    original = getattr(source if source is not None else owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _TARGET
        # Pinned host memory is a CUDA allocation (context parallelism's RoPE pins its chunk indices): without CUDA
        # there is nothing to pin for.
        kwargs.pop("pin_memory", None)
        # A module's function is looked up at each call: the emulated GPU replaces torch.tensor after this import.
        return (getattr(source, name) if source is not None else original)(*args, **kwargs)

    setattr(owner, name, wrapper)


class _TorchForMegatron(types.ModuleType):
    """What `torch` means inside megatron.* modules: real torch, except that the tensor factories map
    device="cuda" to the CPU (and `distributed` is `_DistributedForMegatron`). Scoped to Megatron because wrapping
    the global factories breaks transformers 5's meta-device model loading (its non-persistent buffers, e.g. rotary
    inv_freq, come out uninitialised)."""

    def __getattr__(self, name):
        return getattr(torch, name)


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
    # The MoE alltoall dispatcher passes split sizes as tensors (numpy arrays after its device-to-host copy on a
    # GPU); this torch's c10d binding accepts only sequences of ints.
    if output_split_sizes is not None:
        output_split_sizes = [int(size) for size in output_split_sizes]
    if input_split_sizes is not None:
        input_split_sizes = [int(size) for size in input_split_sizes]
    return torch.distributed.all_to_all_single(output, input, output_split_sizes, input_split_sizes, *args,
                                               **kwargs)


class _Done:
    """The handle of a collective that has already finished."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    # gloo gathers equal shapes only; the MoE alltoall dispatcher gathers each rank's token count over the experts'
    # tensor-parallel group (NCCL takes uneven ones): uneven ones go padded to the longest, then are cut back.
    shapes = {tuple(t.shape) for t in tensor_list} | {tuple(tensor.shape)}
    if len(shapes) == 1:
        return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    longest = max(t.shape[0] for t in [*tensor_list, tensor])
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in tensor_list]
    torch.distributed.all_gather(parts, padded, group=group)
    for out, part in zip(tensor_list, parts):
        out.copy_(part[:out.shape[0]])
    return _Done() if async_op else None


class _DistributedForMegatron(types.ModuleType):
    """What `torch.distributed` means inside megatron.* modules: the real one but for `_all_to_all_single` and
    `_all_gather`."""

    all_to_all_single = staticmethod(_all_to_all_single)
    all_gather = staticmethod(_all_gather)

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like", "ones_like",
              "full_like", "rand", "randn", "randint", "as_tensor")
_TORCH_FOR_MEGATRON = _TorchForMegatron("torch")
for _name in _FACTORIES:
    _redirect_device_kwarg(_TORCH_FOR_MEGATRON, _name, source=torch)
_TORCH_FOR_MEGATRON.distributed = _DistributedForMegatron("torch.distributed")


def _scope_factories_to_megatron() -> None:
    """Point the `torch` global of every loaded megatron.* module at `_TORCH_FOR_MEGATRON`."""
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "torch", None) is torch:
            module.torch = _TORCH_FOR_MEGATRON


class _NoOpStreamOrEvent:
    """Stands for torch.cuda.Stream / Event: on CPU everything is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def query(self):
        return True

    def record_event(self, *args, **kwargs):
        # The MoE alltoall dispatcher records an event on its device-to-host stream and later synchronises on it.
        return _NoOpStreamOrEvent()

    def elapsed_time(self, other):
        return 0.0


def apply() -> bool:
    """Patch torch.cuda / Megatron-Core for CPU if CUDA is absent. Returns True if patched. Idempotent. With
    SLIMISH_EMULATED_GPU=1, "cuda" means the emulated GPU instead of the CPU (`slimish.compat.emulated_gpu`)."""
    global _APPLIED, _TARGET
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    from slimish.compat import emulated_gpu

    if emulated_gpu.requested():
        emulated_gpu.enable()
        _TARGET = emulated_gpu.DEVICE
    from slimish.compat.cuda_driver_stub import preload_if_needed

    preload_if_needed()  # flash_mla, probed by megatron.core, links libcuda.so.1
    _APPLIED = True
    _patch_torch_cuda()
    _patch_megatron()
    return True


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _TARGET  # Megatron passes this as device=...
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.manual_seed = lambda seed: None
    cuda.Stream = _NoOpStreamOrEvent
    cuda.Event = _NoOpStreamOrEvent
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.current_stream = lambda *a, **k: _NoOpStreamOrEvent()
    cuda.default_stream = lambda *a, **k: _NoOpStreamOrEvent()
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    # Pinned host memory is a CUDA allocation: without CUDA there is nothing to pin for (Megatron's CPU-offloading
    # optimizer pins its host copies unasked, on the emulated GPU).
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"):
        _redirect_device_kwarg(torch.Tensor, name)
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and _is_cuda(args[0]):
            args = (_TARGET,) + tuple(args[1:])
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _TARGET
        return original_to(self, *args, **kwargs)

    torch.Tensor.cuda = lambda self, *a, non_blocking=False, **k: to(self, _TARGET, non_blocking=non_blocking)

    torch.Tensor.to = to


def _name_cpu_types_as_cuda_for_megatron() -> None:
    """`t.type()` (no argument) on a CPU tensor answers 'torch.cuda.<Type>' when megatron.core asks: its optimizers
    sort parameters into fp32 / fp16 / bf16 groups, and its grad clipping checks grads, by comparing these names.
    Any other caller, and every other use of `type()`, gets torch's answer."""
    original = torch.Tensor.type

    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        if not (args or kwargs) and self.device.type not in ("cpu", "cuda"):  # the emulated GPU
            return original(self.cpu_data).replace("torch.", "torch.cuda.", 1)
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return name.replace("torch.", "torch.cuda.", 1) if caller.startswith("megatron.core.") else name

    torch.Tensor.type = type_


def _identity_compile(model=None, **options):
    """What `torch.compile` is while Megatron-Core is imported on the CPU: the function itself, uncompiled."""
    return model if model is not None else (lambda fn: fn)


HIDDEN_DURING_IMPORT = ("flashinfer", "wandb")  # see _without_unused_imports


@contextlib.contextmanager
def _without_unused_imports():
    """Megatron-Core's import on the CPU, without imports a CPU trainer never uses (a trainer's setup took 14-22 s
    with the first two, 7.8 s without, beside a running CI):
    - flashinfer (CUDA kernels; Megatron imports it only for its dynamic inference context's fused RoPE) and W&B
      (Megatron's inference context and timers import it when installed, for loggers slimish's trainer never
      uses: its metrics go to W&B from the driver; ~0.7 s of a trainer's start) are unimportable inside the
      window, so Megatron records them absent; other code may import them afterwards;
    - torch._inductor and torch._dynamo, which `torch.compile` imports: Megatron's `jit_fuser` is `torch.compile`
      and decorates a few fusions at import time (torch's optimizers import torch._dynamo later all the same, but
      not the ~600 modules of torch._inductor). Inside the window it decorates with the function itself, and
      after it Megatron's own `disable_jit_fuser()` makes later imports do the same: those functions run eagerly,
      the same maths (slimish's model config turns Megatron's bias/rope/softmax fusions off; what is left, e.g. the
      MoE router's expert bias, would otherwise be compiled by inductor on the CPU). `torch.compile` is torch's
      again after the window."""
    hidden = [name for name in HIDDEN_DURING_IMPORT if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    compile_ = torch.compile
    torch.compile = _identity_compile
    try:
        yield
        import megatron.core.jit

        megatron.core.jit.disable_jit_fuser()
    finally:
        torch.compile = compile_
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def _patch_megatron() -> None:
    # Import everything the trainer uses, then scope the device="cuda" factory redirect to those modules.
    with _without_unused_imports():
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.pipeline_parallel.schedules  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
    import megatron.core.tensor_parallel.random as tp_random
    # Dropout RNG states: keep the "CUDA" generator states on the CPU generator.
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    tp_random.CudaRNGStatesTracker.add = add
    logging.getLogger(tp_random.__name__).setLevel(logging.ERROR)

    _name_cpu_types_as_cuda_for_megatron()
    from slimish.compat import emulated_gpu

    if emulated_gpu.enabled():
        emulated_gpu.patch_hybrid_optimizer()

    # The MoE utilities' Transformer-Engine names, absent here as on any machine without TE (not CPU-specific:
    # `build_gpt_model` applies it on GPUs too).
    from slimish.compat import megatron_te_absent

    megatron_te_absent.apply()
    _scope_factories_to_megatron()
