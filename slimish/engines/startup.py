"""What an engine that is not up yet is waiting for, in words a user can act on (`EngineServers._wait_healthy` puts
it in the line a start that outlasts rollout.engine.startup_timeout_s raises).

The server's log is at --log-level warning, so its progress lines are not there to read; its process group is: a
kernel compiler running in it means a JIT is compiling CUDA kernels at first use. FlashInfer's sampling and attention
kernels do so when its prebuilt kernels are not installed (several minutes per engine on a cold node, and every
engine of a job compiles at once), which `make venv-gpu` installs with `python -m flashinfer download-kernels`.
"""

from __future__ import annotations

# Command names (/proc/<pid>/comm) of a CUDA kernel build: nvcc's front end and back ends, and the build drivers
# FlashInfer's and torch's JITs run.
KERNEL_COMPILERS = frozenset({"nvcc", "cicc", "ptxas", "fatbinary", "nvlink", "ninja", "cc1plus"})


def waiting_for(commands: list[str], *, part: int) -> str:
    """What an engine part whose processes run `commands` (`ManagedProcess.commands`) is waiting for."""
    compiling = sorted(set(commands) & KERNEL_COMPILERS)
    if compiling:
        return (f"compiling CUDA kernels ({', '.join(compiling)} running in it: a JIT at first use, FlashInfer's "
                "unless its prebuilt kernels are installed; `make venv-gpu` installs them with `python -m flashinfer "
                "download-kernels`, or raise rollout.engine.startup_timeout_s)")
    if part > 0:
        return "its schedulers (a node part's /health): its ranks meeting part 0's, then loading their weights"
    return ("its first generation (/health_generate): its ranks loading weights, capturing CUDA graphs or meeting "
            "each other; the log says which")
