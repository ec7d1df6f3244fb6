"""Can this process use the GPUs it was given, and if not, why: one line a user can act on.

A job that reserved GPUs but runs torch on the CPU is the silent failure this prevents: `parallel.backend: auto`
would pick gloo, the model would train on the CPU, and the engines would fail in their own way later. The causes
seen in the field, each told apart by a fact gathered here without initialising a CUDA context:
- torch is a CPU build (`torch.version.cuda` is None): the GPU stack is not installed;
- `CUDA_VISIBLE_DEVICES` hides the GPUs (empty, `-1`, `NoDevFiles`, an index the node lacks);
- no NVIDIA driver on the node (`libcuda.so.1` does not load, or only slimish's CPU stand-in for it,
  `slimish.compat.cuda_driver_stub`, is loaded);
- the driver is older than the CUDA torch was built for (the pinned torch is built for CUDA 13: driver R580 or newer,
  or the cuda-compat package of that CUDA).

`slimish check-gpu` checks a node. `collect()` reads the facts in the calling process; `problem()` turns them into
the one line, or None when CUDA works (`cause()` is its clause saying why). They are split so that the reasoning is
tested with every cause, and the collection on this machine as it is.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

from slimish.compat.cuda_driver_stub import real_driver_library

HIDING_VALUES = {"", "-1", "NoDevFiles", "none", "void"}


@dataclass(frozen=True)
class CudaFacts:
    node: str                          # the host these facts are from
    cuda_visible_devices: str | None   # None: unset
    torch_version: str
    torch_cuda: str | None             # the CUDA torch was built for ("13.0"); None for a CPU build
    driver_loaded: bool                # a real libcuda.so.1 (not the CPU stand-in) loads
    driver_version: str | None         # the kernel module's version ("580.65.06"), from /proc/driver/nvidia/version
    driver_cuda: str | None            # the newest CUDA the driver supports ("12.2"), from cuDriverGetVersion
    device_count: int                  # devices torch can use (0 when CUDA is unusable)
    torch_warning: str | None          # the first line of what torch warned when CUDA initialisation failed


def collect() -> CudaFacts:
    import torch

    driver_loaded, driver_cuda = _driver_library()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        usable = torch.cuda.is_available()
    said = [str(w.message).splitlines()[0] for w in caught if "CUDA" in str(w.message)]
    return CudaFacts(node=socket.gethostname(), cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                     torch_version=torch.__version__, torch_cuda=torch.version.cuda, driver_loaded=driver_loaded,
                     driver_version=_kernel_module_version(), driver_cuda=driver_cuda,
                     device_count=torch.cuda.device_count() if usable else 0,
                     torch_warning=said[0] if said else None)


def problem(facts: CudaFacts, *, gpus: int, holder: str, node: str | None = None) -> str | None:
    """Why `holder` (e.g. "trainer rank 0"), given `gpus` GPUs by Ray on `node` (default: the host the facts are
    from), cannot use them; None when it can. One line: the cause and what to change."""
    if facts.device_count >= gpus:
        return None
    return f"{holder} holds {gpus} GPU{'s' * (gpus > 1)} from Ray on {node or facts.node}, but {cause(facts)}"


def cause(facts: CudaFacts) -> str:
    """Why CUDA is unusable where `facts` were collected, and what to do about it (a clause, lower case)."""
    visible = facts.cuda_visible_devices
    if facts.torch_cuda is None:
        return (f"torch {facts.torch_version} is a CPU-only build: install the GPU stack (make venv-gpu, "
                "requirements/gpu-lock.txt)")
    if visible is not None and visible.strip() in HIDING_VALUES:
        return (f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU: unset it, or stop whatever sets it (Ray "
                "sets it per actor; a job script must not)")
    if not facts.driver_loaded:
        return ("no NVIDIA driver is installed (libcuda.so.1 does not load): run on GPU nodes, or declare no GPUs "
                "to Ray (SLIMISH_RAY_NUM_GPUS=0)")
    needed = _version(facts.torch_cuda)
    if facts.driver_cuda and needed and _version(facts.driver_cuda) < needed:
        driver = f"NVIDIA driver {facts.driver_version}" if facts.driver_version else "the NVIDIA driver"
        return (f"{driver} supports CUDA up to {facts.driver_cuda} and torch {facts.torch_version} needs CUDA "
                f"{facts.torch_cuda}: install driver R580 or newer, or cuda-compat-{facts.torch_cuda.replace('.', '-')}"
                " on LD_LIBRARY_PATH")
    said = f" (torch: {facts.torch_warning})" if facts.torch_warning else ""
    return (f"torch sees {facts.device_count} usable GPU(s) with CUDA_VISIBLE_DEVICES={visible!r}{said}: "
            "check nvidia-smi on that node")


def _driver_library() -> tuple[bool, str | None]:
    """(a real driver library loads, the CUDA version it supports); slimish's CPU stand-in for libcuda.so.1 is no
    driver (`real_driver_library`)."""
    lib = real_driver_library()
    if lib is None:
        return False, None
    version = ctypes.c_int(0)
    # cuDriverGetVersion needs no cuInit and no device: it answers even when the driver is too old for torch.
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return True, None
    return True, f"{version.value // 1000}.{version.value % 1000 // 10}"


def _kernel_module_version() -> str | None:
    try:
        return kernel_module_version(Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        return None


def kernel_module_version(text: str) -> str | None:
    """The driver version in the text of /proc/driver/nvidia/version: the first dotted number of its NVRM line,
    whichever module wrote it ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 ...", or
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...")."""
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            found = re.search(r"\b\d+\.\d+(?:\.\d+)?\b", line)
            return found.group(0) if found else None
    return None


def _version(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in (text or "").split("."))
    except ValueError:
        return ()

