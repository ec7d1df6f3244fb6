"""Where a verified sync's time goes on the CPU: the sender's hashing thread against its path.

    python tools/profile_sync_hashing.py [--transports tensor,broadcast,disk] [--layers 8] [--rounds 3]

Builds the weight-sync bench's Qwen3 (bench/weight_sync.py), starts one SGLang CPU engine of two tensor-parallel
ranks, and per transport and route (full, sharded) syncs it `--rounds` times, verified. Every hash call of the
sender's hashing thread (`ExpectedChecksums`) is split into its copy to a contiguous tensor and its SHA-256, each
timed with the thread's own CPU time and run-queue wait (/proc/thread-self/schedstat); what is neither was blocked
(the GIL, I/O). Per round it prints the sync's seconds, the CPU-seconds of the sender and the engine, when the
path ended (`time_transfer_s`) and the hashing thread's span, CPU, run-queue wait and blocked time, and the bytes it
hashed from strided views. What it found: docs/weight-sync.md, "Calibration on the CPU". A diagnostic: it wraps
`slimish.weight_sync.checksums._Sha.update` for the run, so it times exactly what a sync runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import weight_sync as bench  # noqa: E402  (bench/weight_sync.py: the same model and engine)

from slimish.weight_sync import checksums  # noqa: E402

CALLS: list[tuple] = []  # (start, end, copy cpu, copy runq, sha cpu, sha runq, bytes, strided)


def _sched() -> tuple[float, float]:
    """This thread's (CPU-seconds, seconds waiting on the run queue) so far."""
    with open("/proc/thread-self/schedstat") as f:
        cpu, wait = f.read().split()[:2]
    return int(cpu) / 1e9, int(wait) / 1e9


def _timed_update(self, tensor: torch.Tensor):
    t0, (c0, r0) = time.monotonic(), _sched()
    flat = tensor.detach().to(dtype=self.dtype, device="cpu").contiguous()
    c1, r1 = _sched()
    self._sha.update(memoryview(flat.reshape(-1).view(torch.uint8).numpy()))
    c2, r2 = _sched()
    CALLS.append((t0, time.monotonic(), c1 - c0, r1 - r0, c2 - c1, r2 - r1, flat.numel() * flat.element_size(),
                  not tensor.is_contiguous()))
    return self


def summary(t0: float) -> str:
    """The hashing thread's calls since `t0`."""
    calls = [c for c in CALLS if c[0] >= t0]
    if not calls:
        return "no hashes"
    wall = sum(c[1] - c[0] for c in calls)
    cpu, runq = sum(c[2] + c[4] for c in calls), sum(c[3] + c[5] for c in calls)
    return (f"hashing thread {min(c[0] for c in calls) - t0:.2f}..{max(c[1] for c in calls) - t0:.2f}s: "
            f"cpu {cpu:.2f} (copies {sum(c[2] for c in calls):.2f}, sha {sum(c[4] for c in calls):.2f}) "
            f"run queue {runq:.2f} blocked {max(0.0, wall - cpu - runq):.2f}; "
            f"{sum(c[6] for c in calls) / 2**20:.0f} MiB, {sum(c[6] for c in calls if c[7]) / 2**20:.0f} strided")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default="tensor,broadcast,disk")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from slimish.weight_sync.sender import sync_to
    from slimish.weight_sync.sharding import EngineLayout

    checksums._Sha.update = _timed_update
    root = Path(tempfile.mkdtemp(prefix="profile-sync-"))
    engines = []
    try:
        model, arch, tensors, _ = bench.load_model(root, args.layers)
        engines = bench.start_engines(model, root, count=1, tp=2)
        urls, pids = [url for _, url in engines], [proc.pid for proc, _ in engines]
        sharding = checksums.sharding_of(urls[0], api_key=None)
        for transport in args.transports.split(","):
            for route in ("full", "sharded"):
                sync = sync_to(urls, transport=transport, group_name=f"profile_{transport}_{route}",
                               bucket_bytes=64 << 20, disk_dir=str(root / "disk"), engine_tp=2,
                               expected_checksums=functools.partial(checksums.ExpectedChecksums, arch, torch.float32,
                                                                    sharding),
                               layout=EngineLayout(arch, sharding) if route == "sharded" else None)
                sync.connect()
                try:
                    for round_ in range(args.rounds):
                        engine_cpu = sum(bench._tree_cpu_s(pid) for pid in pids)
                        t0, c0 = time.monotonic(), time.process_time()
                        metrics = sync.send(iter(tensors), version=f"{transport}-{route}-{round_}")
                        seconds = time.monotonic() - t0
                        engine_cpu = sum(bench._tree_cpu_s(pid) for pid in pids) - engine_cpu
                        print(f"{transport} {route} round {round_}: {seconds:.2f}s, cpu sender "
                              f"{time.process_time() - c0:.2f} engine {engine_cpu:.2f}, path ended at "
                              f"{metrics['time_transfer_s']:.2f}s | {summary(t0)} | load average "
                              f"{os.getloadavg()[0]:.1f} | threads {threading.active_count()}", flush=True)
                finally:
                    sync.close()
    finally:
        for proc, _ in engines:
            proc.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
