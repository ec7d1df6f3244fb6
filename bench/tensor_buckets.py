"""Benchmark the `tensor` transport's buffers: a fresh buffer per bucket (what it does on GPUs) against two buffers
reused from bucket to bucket (what it does on the CPU), each bucket handed to a receiving process by handle and
copied out there, as an SGLang engine does; measured in the same run.

    python bench/tensor_buckets.py [--device cpu|cuda] [--model-mib 512] [--bucket-mb 64] [--rounds 3]

The sender flattens each bucket (`FlatBuffers`) and pickles a handle to it the transport's way
(`slimish.weight_sync.tensor.serialize`: shared memory by name on the CPU, CUDA IPC with the device's UUID on a GPU);
the receiver, a spawned process (with SGLang's device-UUID reductions on CUDA, as an engine has them), rebuilds the
tensor, copies it into its own buffer on its device, drops it, and answers. The sender waits for the answer before
the next bucket, and drops a fresh buffer after it. On CUDA the receiver drops the tensor before it answers, so
torch's release synchronises its stream first: that makes the reused buffers safe here, as SGLang's scheduler does
it today (see the transport's docstring for why the transport does not rely on it). A fresh buffer pays an
allocation and an IPC mapping per bucket; the question for GPUs is how much. Best of --rounds. The last line is
    fresh_vs_reused=<x> fresh_s=<s> reused_s=<r> device=<d> model_mib=<m> buckets=<n>
with x = fresh time / reused time. On CUDA it needs SGLang installed (both ends use its device-UUID mapping).
Measured so far on the CPU only (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import base64
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.flatten import model_tensors  # noqa: E402
from slimish.weight_sync.buckets import FlatBuffers, plan_buckets  # noqa: E402
from slimish.weight_sync.tensor import _crossing, serialize, share_by_name  # noqa: E402


def receive(conn, device: str, capacity: int) -> None:
    """The receiving process: rebuild each bucket from its handle, copy it into its own buffer, answer."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's rebuild functions)

    if device == "cuda":
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    torch.multiprocessing.set_sharing_strategy("file_system")
    own = torch.empty(capacity, dtype=torch.uint8, device=device)
    while (payload := conn.recv()) is not None:
        flat = ForkingPickler.loads(base64.b64decode(payload))["flattened_tensor"]
        own[:flat.numel()].copy_(flat)
        del flat  # on CUDA: torch syncs this process's stream, then lets the sender's block go
        conn.send(True)


def send_all(conn, buckets, buffers: FlatBuffers) -> float:
    t0 = time.perf_counter()
    for bucket in buckets:
        flat = buffers.flatten(bucket)
        conn.send(serialize({"flattened_tensor": _crossing(flat), "metadata": []}))
        conn.recv()
        del flat
    if buckets[0].tensors[0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model-mib", type=float, default=512.0)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensors = [(name, t.to(args.device)) for name, t in model_tensors(args.model_mib)]
    buckets = list(plan_buckets(tensors, int(args.bucket_mb * 2**20)))
    capacity = max(b.nbytes for b in buckets)
    model_mib = sum(b.nbytes for b in buckets) / 2**20
    here, there = mp.get_context("spawn").Pipe()
    receiver = mp.get_context("spawn").Process(target=receive, args=(there, args.device, capacity), daemon=True)
    receiver.start()
    try:
        results = {}
        for name, reuse in (("fresh", False), ("reused", True)):
            results[name] = min(send_all(here, buckets, FlatBuffers(share=share_by_name, reuse=reuse))
                                for _ in range(args.rounds))
            print(f"{name:>6} buffers: {results[name]:.3f}s ({model_mib / 1024 / results[name]:.2f} GiB/s)",
                  flush=True)
    finally:
        here.send(None)
        receiver.join(timeout=30)
    print(f"fresh_vs_reused={results['fresh'] / results['reused']:.2f} fresh_s={results['fresh']:.3f} "
          f"reused_s={results['reused']:.3f} device={args.device} model_mib={model_mib:.0f} buckets={len(buckets)}",
          flush=True)


if __name__ == "__main__":
    main()
