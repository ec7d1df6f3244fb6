"""Benchmark host <-> device copies of the sizes the trainer and weight sync move: pinned host memory against
pageable, both directions, measured in the same run.

    python bench/host_device_copies.py [--device cuda|cpu] [--mib 1024] [--rounds 5]

The trainer keeps each step's data in host memory (pinned on a GPU) and moves one micro-batch at a time to the device;
offload (colocation) moves the roles' parameters and optimizer state out and back; the tensor transport's receiving
engine copies each bucket. A copy from pageable memory is staged by the driver through a pinned bounce buffer. Best of
--rounds after one warm-up, CUDA events. On the CPU (the battery's dry run) the device is the CPU: the figures are
memcpy's and only show that the script runs.

Last line:
    pinned_vs_pageable_h2d=<x> h2d_pinned_gbps=<a> h2d_pageable_gbps=<b> d2h_pinned_gbps=<c>
    d2h_pageable_gbps=<d> device=<e>          (one line)
with x = pinned rate / pageable rate, host to device; rates in GB/s (10^9 bytes).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch


def best_seconds(copy, device: str, rounds: int) -> float:
    times = []
    for attempt in range(rounds + 1):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            copy()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            copy()
            seconds = time.perf_counter() - t0
        if attempt:
            times.append(seconds)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    nbytes = args.mib * 2**20
    pin = args.device == "cuda"
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    hosts = {"pinned": torch.ones(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin),
             "pageable": torch.ones(nbytes, dtype=torch.uint8, device="cpu")}
    rates = {}
    for kind, host in hosts.items():
        # non_blocking from pinned memory is a true asynchronous DMA; from pageable memory it is staged either way.
        to_device = functools.partial(device_buffer.copy_, host, non_blocking=True)
        to_host = functools.partial(host.copy_, device_buffer, non_blocking=kind == "pinned")
        h2d = best_seconds(to_device, args.device, args.rounds)
        d2h = best_seconds(to_host, args.device, args.rounds)
        rates[kind] = (nbytes / h2d / 1e9, nbytes / d2h / 1e9)
        print(f"{kind:>8}: host->device {rates[kind][0]:7.2f} GB/s, device->host {rates[kind][1]:7.2f} GB/s "
              f"({args.mib} MiB, best of {args.rounds})", flush=True)
    print(f"pinned_vs_pageable_h2d={rates['pinned'][0] / rates['pageable'][0]:.3f} "
          f"h2d_pinned_gbps={rates['pinned'][0]:.2f} h2d_pageable_gbps={rates['pageable'][0]:.2f} "
          f"d2h_pinned_gbps={rates['pinned'][1]:.2f} d2h_pageable_gbps={rates['pageable'][1]:.2f} "
          f"device={args.device}")


if __name__ == "__main__":
    main()
