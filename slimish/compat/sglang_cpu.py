"""What makes a stock SGLang server serve on a CPU-only machine. Used only when CUDA is absent.

Why each piece (measured on a 2-core CPU box with sglang 0.5.23, see README "CPU notes"):
- LD_PRELOAD of the driver stub: the CUDA `sgl_kernel` wheel links libcuda.so.1 (see cuda_driver_stub).
- SGLANG_USE_CPU_ENGINE=1 + --device cpu: SGLang's pure-torch CPU paths.
- --dtype float32 explicitly: with `auto` the KV cache came out float16 for an fp32 model, breaking logprob parity.
- --attention-backend torch_native, --sampling-backend pytorch: the only CPU-capable backends.
- --sleep-on-idle: an idle scheduler otherwise spins a whole core, halving a 2-core machine.
- --skip-server-warmup, --grammar-backend none: faster start, no xgrammar compile.
Tensor-parallel engines (--tp-size > 1) on the CPU also need (a TP2 engine then serves the TP1 engine's ids and
logprobs, ../shared/reference/GPU-FACTS.md):
- SGLANG_CPU_OMP_THREADS_BIND, one '|'-separated core group per rank: without it SGLang asserts one NUMA node per
  rank (utils/numa_utils.py). Without AMX the groups are checked, not applied (each rank runs one thread, as every
  CPU engine here does: OMP_NUM_THREADS).
- SGLANG_NCCL_SO_PATH pointing at no file: with a CUDA build of torch, SGLang builds a PyNccl communicator on the CPU
  group and dies (`Expected a cuda device, but got: cpu`); PyNccl disables itself when its library fails to load.
- --disable-custom-all-reduce: the CUDA all-reduce otherwise only warns that it cannot start.
"""

from __future__ import annotations

import os
from pathlib import Path

from slimish.compat.cuda_driver_stub import real_driver_present, stub_path

CPU_ENGINE_PATH = Path(__file__).with_name("cpu_engine_path")  # no __init__.py: not a package of slimish


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def server_env(base: dict | None = None, *, tp: int = 1, nnodes: int = 1) -> dict:
    """Environment for an SGLang server process of an engine of `tp` tensor-parallel ranks over `nnodes` nodes (this
    process runs tp / nnodes of them)."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    if not cuda_available():
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        # SGLang's crash diagnostics (a CUDA coredump, py-spy dumps of the other TP ranks' schedulers) have nothing
        # to dump on a CPU engine (no CUDA, one scheduler), but would still sleep 5 s "to let GPU activity settle"
        # at every stop: a stop signals the whole process group, and the server takes its scheduler's end for a crash.
        env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
        env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
        # FlashInfer's CUDA kernels hidden (see cpu_engine_path/flashinfer): a faster start, nothing else changes.
        prepend_pythonpath(env, CPU_ENGINE_PATH)
        if not real_driver_present():
            env["LD_PRELOAD"] = ":".join(p for p in [str(stub_path()), env.get("LD_PRELOAD", "")] if p)
        # One thread per rank, unless the user says otherwise: what Ray gives an engine actor of a CPU sliver
        # (OMP_NUM_THREADS=1), and what the engines started outside Ray (the e2e tests' shared engines) lacked:
        # with one thread per core each, engines, router and trainer oversubscribed a 2-core machine and a job's
        # generation on them took 13x as long (26.7 s against 2.0 s over 6 steps).
        env.setdefault("OMP_NUM_THREADS", "1")
        if tp > 1:
            groups = core_groups(sorted(os.sched_getaffinity(0)), tp // nnodes)  # indexed by the node's own ranks
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, g)) for g in groups))
            env.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
    return env


def prepend_pythonpath(env: dict, folder: Path) -> None:
    """`folder` first on `env`'s PYTHONPATH, before what was there (how an engine's processes get the folders that
    hide packages from them)."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))


def core_groups(cores: list[int], ranks: int) -> list[list[int]]:
    """`cores` dealt into `ranks` groups of consecutive cores, as evenly as they go; with fewer cores than ranks,
    ranks share them (one core each)."""
    if len(cores) < ranks:
        return [[cores[r % len(cores)]] for r in range(ranks)]
    size, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for r in range(ranks):
        end = start + size + (r < extra)
        groups.append(cores[start:end])
        start = end
    return groups


def server_args(*, device: str, dtype: str, tp: int = 1, colocated: bool = False) -> list[str]:
    """Device-specific sglang.launch_server arguments. `colocated`: the engine shares its GPUs with trainer ranks and
    releases its memory while they train, which frees GPU memory only with SGLang's memory saver
    (torch_memory_saver, CUDA-only); on the CPU the release frees nothing, and the flag is left out."""
    if device == "cpu":
        return ["--device", "cpu", "--dtype", dtype, "--attention-backend", "torch_native",
                "--sampling-backend", "pytorch", "--sleep-on-idle", "--skip-server-warmup",
                "--grammar-backend", "none", *(["--disable-custom-all-reduce"] if tp > 1 else [])]
    return ["--device", device, "--dtype", dtype, *(["--enable-memory-saver"] if colocated else [])]


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if cuda_available() else "cpu"
